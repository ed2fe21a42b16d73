"""EGGROLL learning on the embedded default: several settings side by side, held-out accuracy before,
during and after (its learning figure in bench/RESULTS.md).

    python bench/eggroll_learning.py \
        --configs "sigma=0.01,lr=0.05;sigma=0.003,lr=0.1" --set population=512 --set prompts_per_step=32 \
        --set temperature=1.0 --set steps=60 --set eval_every=15 --set eval_examples=500

Each config is one real `gpuscale run --recipe eggroll --gpus 1` with the common --set values and its
own; the runs go at the same time (on one GPU they share it, which slows each but not what it
learns: the seed fixes every draw). The figures are the summaries' greedy and temperature-1
accuracy on the held-out problems before and after, per domain, and the curve the runs logged every
eval_every steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when loaded by path
from record import write_result  # noqa: E402


def launch(settings: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpuscale.app.cli", "run", "--recipe", "eggroll", "--gpus", "1", "--json"]
    for setting in settings:
        cmd += ["--set", setting]
    print("$ gpuscale", " ".join(cmd[3:]), flush=True)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def curve(run_id: int) -> list[dict]:
    """(step, greedy, sampled) every eval_every steps, from the run's metric records."""
    from gpuscale.control.store import Store

    rows = Store.for_reading().metrics(run_id)
    by_step: dict[int, dict] = {}
    for row in rows:
        if row["rank"] == 0 and row["name"] in ("accuracy_greedy", "accuracy_sampled"):
            by_step.setdefault(row["step"], {})[row["name"]] = row["value"]
    return [{"step": step, **values} for step, values in sorted(by_step.items())]


BASELINE = """No baseline: it sets several eggroll settings side by side (held-out accuracy), not gpuscale against
other code."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\n" + BASELINE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", required=True, help="';'-separated configs of ','-separated key=value")
    parser.add_argument("--set", action="append", default=[], help="a setting common to every config")
    parser.add_argument("--home", default=None, help="GPUSCALE_HOME of the runs (default: a new temporary one)")
    parser.add_argument("--out", default=None, help="default: bench/results/eggroll/learning-<date>-<card>.json")
    args = parser.parse_args()
    os.environ["GPUSCALE_HOME"] = args.home or tempfile.mkdtemp(prefix="gpuscale-bench-eggroll-")
    configs = [[item.strip() for item in config.split(",") if item.strip()] for config in args.configs.split(";")]
    started = time.time()
    processes = [launch(args.set + ["save_model=false"] + config) for config in configs]
    results = []
    for config, process in zip(configs, processes):
        run = json.loads(process.communicate()[0])
        summary = run.get("summary") or {}
        figures = {key: value for key, value in summary.items() if "accuracy" in key}
        results.append({"config": config, "run": run["id"], "status": run["status"], "error": run.get("error"),
                        "figures": figures, "curve": curve(run["id"]),
                        "members_per_s": summary.get("members_per_s")})
    write_result("eggroll", "learning", {"configs": configs, "common": args.set, "home": args.home},
                 {"seconds": time.time() - started, "results": results}, out=args.out)
    print(f"\n{'config':<32} {'status':<10} {'greedy':>15} {'sampled':>15}")
    for r in results:
        f = r["figures"]

        def change(kind: str, f=f) -> str:
            before, after = f.get(f"accuracy_{kind}_before"), f.get(f"accuracy_{kind}_after")
            return f"{100 * before:.1f} -> {100 * after:.1f}" if before is not None and after is not None else "-"

        print(f"{','.join(r['config']):<32} {r['status']:<10} {change('greedy'):>15} {change('sampled'):>15}")
        for point in r["curve"]:
            print(f"    step {point['step']}: greedy {point.get('accuracy_greedy')}, "
                  f"sampled {point.get('accuracy_sampled')}")


if __name__ == "__main__":
    main()
