"""fetch against a server that misbehaves: it trickles, sends without end,
announces too much, redirects in a loop, or is cut short by SIGTERM. Each ends
in one line, in bounded time, with no partial file left in --out.

The server is a thread on 127.0.0.1 (http.server); every handler's loop is
bounded and stops by itself when the client goes away.

    .venv/bin/python -m pytest -q tests/test_fetch_bounds.py
"""
import http.server
import importlib
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError

REPO = Path(__file__).resolve().parents[1]
fetch_module = importlib.import_module("hpctrain.data.fetch")   # data.fetch is the function


class Misbehaving(http.server.BaseHTTPRequestHandler):
    """/trickle/: announces 100 bytes, sends one every 0.1 s. /endless/: no
    length, 64 KB blocks (at most 128 MB). /big/: announces 10 GB. /loop/:
    redirects to itself."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        kind = self.path.strip("/").split("/")[0]
        try:
            if kind == "loop":
                self.send_response(302)
                self.send_header("Location", self.path)
                self.end_headers()
                return
            self.send_response(200)
            if kind != "endless":
                self.send_header("Content-Length", str(10 << 30 if kind == "big" else 100))
            self.end_headers()
            if kind == "trickle":
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif kind == "endless":
                for _ in range(2048):
                    self.wfile.write(b"y" * (64 << 10))
        except OSError:   # the client gave up: that is the point
            pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def no_part_files(out):
    return not any(".part" in p.name for p in Path(out).iterdir())


def test_a_trickle_ends_at_the_whole_download_deadline(server, tmp_path):
    # One byte every 0.1 s never leaves the socket silent for --timeout 0.5;
    # before, the 100 bytes took 10 s and then failed the checksum.
    start = time.monotonic()
    with pytest.raises(HpctrainError, match=r"trickle/train-images-idx3-ubyte.gz: \d+ of at most "
                                            r"100 bytes in 0.5 s, slower than 32 KB/s"):
        data.fetch("mnist", tmp_path, mirror=server + "trickle/", log=None, timeout=0.5)
    assert time.monotonic() - start < 5
    assert no_part_files(tmp_path)


def test_an_endless_body_stops_at_the_size_cap(server, tmp_path, monkeypatch):
    monkeypatch.setitem(fetch_module.MAX_BYTES, "mnist", 1 << 20)
    with pytest.raises(HpctrainError, match=r"endless/train-images-idx3-ubyte.gz: more than "
                                            r"1048576 bytes, more than any file of this dataset"):
        data.fetch("mnist", tmp_path, mirror=server + "endless/", log=None, timeout=5)
    assert no_part_files(tmp_path)


def test_an_announced_length_beyond_the_cap_is_refused_before_a_byte(server, tmp_path):
    with pytest.raises(HpctrainError, match=r"announces 10737418240 bytes, more than any file "
                                            r"of this dataset \(67108864\); not downloaded"):
        data.fetch("mnist", tmp_path, mirror=server + "big/", log=None, timeout=5)
    assert no_part_files(tmp_path)


def test_a_redirect_loop_is_one_line(server, tmp_path):
    with pytest.raises(HpctrainError, match=r"loop/train-images-idx3-ubyte.gz: HTTP 302 ") as e:
        data.fetch("mnist", tmp_path, mirror=server + "loop/", log=None, timeout=5)
    assert "\n" not in str(e.value) and "infinite loop" in str(e.value)


def test_a_corrupt_archive_is_one_line(tmp_path):
    # Neither a zip nor a tar: tarfile's message lists every method it tried, a line each.
    archive = tmp_path / "cifar-10-binary.tar.gz"
    archive.write_bytes(b"not an archive at all" * 100)
    with pytest.raises(HpctrainError, match="corrupt archive") as e:
        data.extract(archive, fetch_module.archive_members("cifar-10"), tmp_path, log=None)
    assert "\n" not in str(e.value)
    with tarfile.open(archive.with_name("truncated.tar.gz"), "w:gz") as t:
        t.add(archive, "data_batch_1.bin")
    cut = archive.with_name("truncated.tar.gz")
    cut.write_bytes(cut.read_bytes()[:60])
    with pytest.raises(HpctrainError) as e:
        data.extract(cut, fetch_module.archive_members("cifar-10"), tmp_path, log=None)
    assert "\n" not in str(e.value)


def test_sigterm_removes_the_part_file(server, tmp_path):
    # Before: SIGTERM's default action ended fetch with its .NAME.part-XXXX left in --out.
    out = tmp_path / "raw"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.data", "fetch", "--out", out,
                             "--mirror", server + "trickle/", "--timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(300):   # until the download has begun
            if out.is_dir() and not no_part_files(out):
                break
            time.sleep(0.05)
        assert not no_part_files(out), "the download never began"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert err == ("hpctrain: error: fetch stopped by SIGTERM; the partial download "
                   "was removed\n")
    assert list(out.iterdir()) == []

