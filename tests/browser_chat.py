"""Drives notebook 08 in JupyterLab with a headless Chromium: run every cell, type a message
into the chat widget, wait for the reply to stream in with its tok/s, keep a screenshot.
Started by tests/browser_chat.sh (not collected by pytest: it needs a browser)."""

import os
import pathlib
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

from playwright.sync_api import TimeoutError, sync_playwright

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHOT = ROOT / "runs" / "browser" / "chat.png"
LAB_LOG = SHOT.with_name("jupyterlab.log")  # the server's own log, kept for a failed run
MESSAGE = "Tell me about the ring cache."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int, token: str, log) -> subprocess.Popen:
    """JupyterLab on localhost, the repository as its root, this environment's kernel."""
    lab = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={ROOT}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    for _ in range(120):  # up to a minute for the server to answer
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return lab
        except OSError:
            time.sleep(0.5)
    lab.kill()
    raise SystemExit(f"JupyterLab did not start on localhost: see {LAB_LOG}")


def run_all(page) -> None:
    """Run > Run All Cells, until the kernel is busy (a click that lands while the menu still
    opens is lost: seen here, the kernel stayed idle)."""
    busy = ".jp-Notebook-ExecutionIndicator[data-status='busy']"
    for _ in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click(timeout=30_000)
        page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
        try:
            page.wait_for_selector(busy, timeout=15_000)
            return
        except TimeoutError:
            page.keyboard.press("Escape")
    raise SystemExit("Run All Cells did not start the kernel")


def main() -> None:
    port, token = free_port(), secrets.token_hex(16)
    SHOT.parent.mkdir(parents=True, exist_ok=True)
    with open(LAB_LOG, "w") as log:
        lab = serve(port, token, log)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium",
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/08_use_it.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook", timeout=120_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            run_all(page)
            box = page.locator("input[placeholder='a message, then Enter']")
            box.wait_for(timeout=20 * 60_000)  # every cell before the chat: compiles on a CPU take minutes
            page.wait_for_function(  # the scripted first turn has landed in the log
                "() => [...document.querySelectorAll('.widget-html-content')].some(e => e.innerText.includes('tok/s'))",
                timeout=10 * 60_000,
            )
            box.fill(MESSAGE)
            box.press("Enter")
            page.wait_for_function(
                f"() => [...document.querySelectorAll('.widget-html-content')].some(e => e.innerText.includes({MESSAGE!r})"
                " && (e.innerText.match(/tok\\/s/g) || []).length >= 2)",
                timeout=10 * 60_000,
            )
            box.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOT), full_page=False)
            log = page.locator(".widget-html-content", has_text=MESSAGE).first.inner_text()
            browser.close()
        print(log)
        print(f"screenshot: {SHOT}")
    finally:
        lab.terminate()


if __name__ == "__main__":
    main()
