-- The schema of runs.db (version 4) as gpuscale made it before the sample fields were declared in
-- gpuscale/runs/sample_fields.py (commit 86fa980): tests/unit/test_sample_fields.py opens a history made by it.
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE "runs" (
   "id" INTEGER PRIMARY KEY,
   "recipe" TEXT,
   "status" TEXT,
   "settings" TEXT,
   "summary" TEXT,
   "error" TEXT,
   "hint" TEXT,
   "created_at" REAL,
   "started_at" REAL,
   "ended_at" REAL,
   "supervisor_pid" INTEGER,
   "supervisor_started" REAL,
   "launcher_pid" INTEGER,
   "exit_code" INTEGER,
   "run_dir" TEXT,
   "command" TEXT,
   "host" TEXT,
   "progress" TEXT
, "label" TEXT, "parent_id" INTEGER);
CREATE TABLE "metrics" (
   "run_id" INTEGER REFERENCES "runs"("id"),
   "rank" INTEGER,
   "t" REAL,
   "step" INTEGER,
   "name" TEXT,
   "value" REAL
);
CREATE INDEX "idx_metrics_run_id_name_t"
    ON "metrics" ("run_id", "name", "t");
CREATE TABLE "samples" (
   "run_id" INTEGER REFERENCES "runs"("id"),
   "t" REAL,
   "kind" TEXT,
   "idx" INTEGER,
   "name" TEXT,
   "mem_used_mb" REAL,
   "mem_total_mb" REAL,
   "util" REAL,
   "power_w" REAL,
   "temp_c" REAL,
   "sm_clock_mhz" REAL,
   "run_mem_mb" REAL
);
CREATE INDEX "idx_samples_run_id_t"
    ON "samples" ("run_id", "t");
CREATE TABLE "tunings" (
   "id" INTEGER PRIMARY KEY,
   "recipe" TEXT,
   "model" TEXT,
   "device" TEXT,
   "precision" TEXT,
   "shape" TEXT,
   "batch_size" INTEGER,
   "throughput" REAL,
   "figure" TEXT,
   "peak_memory_bytes" INTEGER,
   "memory_total_bytes" INTEGER,
   "memory_cap" REAL,
   "compile" INTEGER,
   "trials" TEXT,
   "stopped" TEXT,
   "seconds" REAL,
   "created_at" REAL
);
CREATE UNIQUE INDEX "idx_tunings_recipe_model_device_precision_shape"
    ON "tunings" ("recipe", "model", "device", "precision", "shape");
CREATE INDEX "idx_runs_label"
    ON "runs" ("label");
INSERT INTO schema_version VALUES (4);
