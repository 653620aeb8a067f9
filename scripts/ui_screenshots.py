"""The dashboard's screenshots in docs/img: the runs table, a grid of charts with its legend, the
parallel coordinates with a scatter, and two runs compared. Records a small project of 10 runs in a temporary
directory, serves it with `retrolog ui` and photographs it in Debian's chromium (or
$RETROLOG_CHROMIUM) with Playwright.

    PYTHONPATH=src .venv/bin/python scripts/ui_screenshots.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

OUT = Path(__file__).resolve().parent.parent / "docs" / "img"
TRAIN = """\
import argparse
import math

import retrolog as rl

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--width", type=int, default=64)
args = parser.parse_args()

w = 1.0
for epoch in rl.loop("epoch", range(4)):
    for step in rl.loop("step", range(250)):
        w -= args.lr * w * 0.004
        rl.log("loss", w * (1 + 0.08 * math.sin(step / 9)) + 64 / args.width * 0.05)
        rl.log("lr_now", args.lr * 0.999 ** (epoch * 250 + step))
    rl.log("acc", 1 - 0.9 * w - 8 / args.width)
"""
RUNS = [(0.01, 64), (0.02, 128), (0.05, 64), (0.1, 256), (0.15, 128), (0.2, 64),
        (0.3, 256), (0.4, 128), (0.6, 256), (0.8, 64)]  # fmt: skip


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "demo"
        root.mkdir()
        git = ["git", "-c", "user.name=demo", "-c", "user.email=demo@example.invalid"]
        subprocess.run([*git, "init", "--quiet", "--initial-branch=main"], cwd=root, check=True)
        (root / "train.py").write_text(TRAIN)
        subprocess.run([*git, "add", "train.py"], cwd=root, check=True)
        subprocess.run([*git, "commit", "--quiet", "-m", "train"], cwd=root, check=True)
        env = {**os.environ, "RETROLOG_CHECKPOINTS": "never"}
        for lr, width in RUNS:
            subprocess.run([sys.executable, "train.py", "--lr", str(lr), "--width", str(width)],
                           cwd=root, env=env, check=True, capture_output=True)  # fmt: skip
        server = subprocess.Popen(
            [sys.executable, "-m", "retrolog", "ui", "--no-browser", "--port", "0"],
            cwd=root, env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            url = None
            assert server.stderr is not None
            for line in server.stderr:
                found = re.search(r"(http://\S+/\?token=\S+)", line)
                if found:
                    url = found.group(1)
                    break
            assert url, "retrolog ui printed no address"
            photograph(url)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=20)


def photograph(url: str) -> None:
    chromium = os.environ.get("RETROLOG_CHROMIUM", "/usr/bin/chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    chromium_sandbox=False,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])  # fmt: skip
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']")
        for box in page.locator("#runs tbody input[type=checkbox]").all():
            box.check()
        for name in ("lr_now", "acc", "loss"):
            page.select_option("#chart-name", name)
        page.select_option("#chart-label", "lr")
        page.select_option("#scatter-x", "lr")
        page.select_option("#scatter-y", "acc")
        page.wait_for_function(
            "[...window.__retrolog.grid.cells.values()].every(c => c.state === 'drawn')"
            " && document.getElementById('scatter').dataset.points === '10'"
        )
        page.locator("#chart-view").screenshot(path=str(OUT / "ui-grid.png"))
        page.locator("#explore-view").screenshot(path=str(OUT / "ui-parallel.png"))
        page.locator("#runs-view").screenshot(path=str(OUT / "ui.png"))
        boxes = page.locator("#runs tbody input[type=checkbox]").all()
        for box in boxes[2:]:
            box.uncheck()
        page.click("#compare-selected")
        page.wait_for_selector("#compare-metrics table")
        page.locator("#compare-view").screenshot(path=str(OUT / "ui-compare.png"))
        browser.close()
    print(f"wrote ui.png, ui-grid.png, ui-parallel.png and ui-compare.png in {OUT}")


if __name__ == "__main__":
    main()
