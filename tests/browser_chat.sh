#!/usr/bin/env bash
# Notebook 08's chat where people use it: served by JupyterLab on localhost, driven by a real
# (headless) Chromium through Playwright. Run from the repository root after the README's set-up:
#   bash tests/browser_chat.sh        (needs Debian's chromium: apt-get install chromium)
# Prints the path of the screenshot it keeps.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/bin/chromium ] || { echo "no /usr/bin/chromium: apt-get install chromium" >&2; exit 1; }
.venv/bin/pip install -q -r requirements-browser.txt
.venv/bin/python tests/browser_chat.py
