# CPU-seconds of whole runs (the command and every process it waited for), before and after gc.freeze.
# BEFORE_TREE: a git worktree of 1733daf (the parent of a10bd3d, which froze the imports); /work/main: main at 669cf51.
# Columns: tree, run, user CPU-s, system CPU-s, wall s. Run on the 2-core CPU machine, one command at a time.
run() { # tree label args...
  local tree=$1 label=$2; shift 2
  local home=$(mktemp -d)
  ( cd $tree && PYTHONPATH=$tree GPUSCALE_HOME=$home /usr/bin/time -f "$label %U %S %e" /work/main/.venv/bin/python -c "import sys; from gpuscale.app.cli import main; sys.argv[0]=\"gpuscale\"; sys.exit(main())" run "$@" --json > /dev/null 2>"$home/time.txt"; tail -1 "$home/time.txt" )
  rm -rf $home
}
for i in 1 2 3; do
  for tree in BEFORE_TREE /work/main; do
    run $tree "$(basename $tree) probe1" --recipe probe --gpus 1 --set steps=4 --set prompt_tokens=8 --batch-size 2
    run $tree "$(basename $tree) sft2" --recipe sft --gpus 2 --set max_examples=8 --set max_steps=2 --set max_length=64 --set eval_examples=2 --batch-size 2
  done
done
