#!/usr/bin/env bash
# The main job end to end: record two runs of a real training script, then read them back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
demo=$(mktemp -d "${TMPDIR:-/tmp}/retrolog-demo.XXXXXX")
cp examples/train_digits.py "$demo/"
cd "$demo"
git init --quiet .   # a project of its own; retrolog never touches its branch, index or HEAD
echo "== recording two runs in $demo"
python train_digits.py --kwargs lr=0.05 epochs=4
python train_digits.py --kwargs lr=0.01 epochs=4 hidden=32 --seed 1
echo "== retrolog runs"
retrolog runs
echo "== retrolog dataframe lr hidden acc   (one row per run and epoch)"
retrolog dataframe lr hidden acc
echo "== retrolog dataframe test_acc --where \"lr > 0.02\""
retrolog dataframe lr test_acc --where "lr > 0.02"
echo "== the same from Python"
python -c "import retrolog as rl; print(rl.dataframe('loss', 'acc').groupby(['run_id', 'epoch'])[['loss', 'acc']].agg({'loss': 'mean', 'acc': 'last'}))"
echo "== git status of the demo project (untouched: no commits, nothing staged)"
git status --short --branch
