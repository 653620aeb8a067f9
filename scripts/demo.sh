#!/usr/bin/env bash
# The main job end to end: record runs of a real training script across two code versions,
# add hindsight log statements, replay the past runs, and show the backfilled values.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
demo=$(mktemp -d "${TMPDIR:-/tmp}/retrolog-demo.XXXXXX")/digits
mkdir "$demo"
cp examples/train_digits.py "$demo/"
cd "$demo"
git init --quiet .
git add train_digits.py
git -c user.name=demo -c user.email=demo@example.invalid commit --quiet -m "version 1"

echo "== recording two runs of version 1 in $demo"
python train_digits.py --kwargs lr=0.05
python train_digits.py --kwargs lr=0.01 hidden=128 --seed 1

echo "== version 2 (uncommitted edit: weight decay), one more run"
python - <<'PY'
from pathlib import Path
p = Path("train_digits.py")
s = p.read_text()
s = s.replace('hidden = rl.arg("hidden", 256)\n',
              'hidden = rl.arg("hidden", 256)\nweight_decay = rl.arg("weight_decay", 0.0)\n')
s = s.replace("lr=lr, momentum=0.9)", "lr=lr, momentum=0.9, weight_decay=weight_decay)")
p.write_text(s)
PY
python train_digits.py --kwargs lr=0.05 weight_decay=0.001 --seed 2
retrolog runs

echo "== today: add two hindsight statements (outer loop: weight norm; inner loop: gradient norm)"
python - <<'PY'
from pathlib import Path
p = Path("train_digits.py")
s = p.read_text()
s = s.replace("        scheduler.step()\n",
              "        scheduler.step()\n"
              "        rl.log(\"w_norm\", sum(p.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n")
s = s.replace("            optimizer.step()\n",
              "            optimizer.step()\n"
              "            rl.log(\"grad_norm\", net[0].weight.grad.norm().item())\n")
p.write_text(s)
PY
git diff --stat

echo "== retrolog replay --verify --yes     (do past runs replay exactly? recorded statements only)"
verify_log="$(dirname "$demo")/verify.log"  # beside the project, not in it
retrolog replay --verify --yes 2>&1 | tee "$verify_log"
# Exact values alone are not enough here: every checkpoint the runs kept must restore.
if grep -q "was not restored" "$verify_log"; then
  echo "demo: a checkpoint could not be restored (above); that is a bug, please report it" >&2
  exit 1
fi
echo "== retrolog replay w_norm --dry-run   (the plan, and the code each past run will execute)"
retrolog replay w_norm --dry-run
echo "== retrolog replay w_norm --yes       (outer loop: epochs restored from checkpoints)"
retrolog replay w_norm --yes
echo "== retrolog replay grad_norm --yes    (inner loop: training re-executed, in parallel)"
retrolog replay grad_norm --yes
echo "== retrolog dataframe lr seed weight_decay acc w_norm   (backfilled for every past run; seed is argparse's)"
retrolog dataframe lr seed weight_decay acc w_norm
echo "== grad_norm per run and epoch, from Python"
python -c "import retrolog as rl; print(rl.dataframe('grad_norm').groupby(['run_id', 'epoch'])['grad_norm'].mean().unstack())"
echo "== git status of the demo project: your files, HEAD and index as you left them"
git status --short --branch
echo "== look at these runs in your browser"
echo "   cd $demo && $(command -v retrolog) ui"
