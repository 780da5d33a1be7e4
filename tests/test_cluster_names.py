"""The simulated cluster's names are per checkout (tests/cluster/names.sh).

Two checkouts testing as root on one machine must not share a network
namespace, an interface, a state directory or SLURM job numbers (MPICH names
a job's /dev/shm segment after them). No root needed: this asks names.sh,
from two copies of the checkout, and reads the scripts that use it.
Run: ``.venv/bin/python -m pytest -q tests/test_cluster_names.py`` (about 1 s).
"""
import re
import shutil
import subprocess
from pathlib import Path

from conftest import REPO

CLUSTER = Path(REPO) / "tests" / "cluster"
IFNAMSIZ = 15          # Linux: an interface name has at most 15 characters
MAX_JOB_ID = 67043328  # SLURM's default MaxJobId
MOST_NODES = 50        # netns.sh up N allows N <= 50


def names_in(checkout, *argv):
    script = checkout / "tests" / "cluster" / "names.sh"
    if not script.exists():
        script.parent.mkdir(parents=True)
        shutil.copy2(CLUSTER / "names.sh", script)
    return subprocess.run([str(script), *argv], capture_output=True, text=True,
                          check=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip()


def settings(checkout):
    return dict(line.split("=", 1) for line in names_in(checkout).splitlines())


def test_two_checkouts_get_their_own_names(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ours, theirs = settings(a), settings(b)
    for key in ("HPT_TAG", "HPT_CLUSTER_DIR", "HPT_BRIDGE", "HPT_FIRST_JOB_ID"):
        assert ours[key] != theirs[key], (key, ours, theirs)
    assert ours == settings(a)  # the same checkout: the same names every time
    for checkout in (a, b):
        for node in ("hpt-n0", "hpt-n1"):
            assert names_in(checkout, "netns", node) != names_in(tmp_path / "c", "netns", node)
            assert names_in(checkout, "veth", node) != names_in(tmp_path / "c", "veth", node)
    assert ours["HPT_CLUSTER_DIR"] == "/tmp/hpctrain-cluster-" + ours["HPT_TAG"]


def test_interface_names_fit_linux_and_job_ids_fit_slurm(tmp_path):
    names = settings(tmp_path)
    assert len(names["HPT_BRIDGE"]) <= IFNAMSIZ, names
    longest = names_in(tmp_path, "veth", f"hpt-n{MOST_NODES - 1}")
    assert len(longest) <= IFNAMSIZ, longest
    first = int(names["HPT_FIRST_JOB_ID"])
    # a block of 1000 ids above the single-node SLURM's 1, 2, 3...
    assert 1000 <= first and first + 1000 <= MAX_JOB_ID and first % 1000 == 0, first


def test_no_script_names_the_cluster_by_itself():
    # Every name that lives in the machine's shared name spaces comes from
    # names.sh: no fixed state directory, namespace, veth or bridge name.
    fixed = re.compile(r"/tmp/hpctrain-cluster\b(?!-)|/run/netns/hpt-n|\bhpt-v\d|\bhpt-v\$|hpt-br0")
    users = [p for p in sorted(CLUSTER.iterdir()) if p.is_file() and p.name != "names.sh"
             and p.suffix in ("", ".sh", ".py")]
    users.append(Path(REPO) / "tests" / "test_cluster.py")
    for path in users:
        text = path.read_text()
        assert not fixed.search(text), f"{path.name}: {fixed.search(text).group(0)}"
    for script in ("netns.sh", "on.sh", "fake-ssh", "slurm.sh", "shape.sh"):
        assert "names.sh" in (CLUSTER / script).read_text(), script
    assert "@FIRST_JOB_ID@" in (CLUSTER / "slurm.conf.in").read_text()
