"""The quick exit keeps what an exit must do: the exit code, atexit handlers, finalizers of garbage."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SCRIPT = """
import atexit, gc, sys
from dynamo_spec.engine.process_exit import install
install(); install()  # once, however often asked
class Cycle:
    def __init__(self, name): self.me, self.name = self, name
    def __del__(self): print("finalized", self.name, flush=True)
Cycle("garbage")  # only a collection can finalize it
kept = Cycle("alive")
atexit.register(lambda: print("handler", flush=True))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code_handlers_and_finalizers_are_kept(code):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    lines = out.stdout.split()
    assert "handler" in lines and "garbage" in lines  # garbage in a cycle is still finalized
    # the quick exit ran last (registered first): the handler printed before the collection
    assert lines.index("handler") < lines.index("garbage")


def test_frozen_at_exit():
    """What survives is frozen before the interpreter's final collections (the time they take)."""
    probe = ("import atexit, gc\nfrom dynamo_spec.engine.process_exit import install\ninstall()\n"
             "keep = [object() for _ in range(1000)]\n"
             "atexit.register(lambda: None)\n"
             "import atexit as a\n"
             "def report():\n    print('frozen', gc.get_freeze_count(), flush=True)\n"
             "# registered after install: runs before it, so reports 0; one registered before install runs after\n")
    out = subprocess.run([sys.executable, "-c", probe + "a.register(report)\n"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["frozen", "0"], out.stdout + out.stderr
    before = ("import atexit, gc\n"
              "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 1000, flush=True))\n"
              "from dynamo_spec.engine.process_exit import install\ninstall()\n"
              "keep = [object() for _ in range(1000)]\n")
    out = subprocess.run([sys.executable, "-c", before], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["frozen", "True"], out.stdout + out.stderr


def test_ray_is_shut_down_at_exit_only_where_it_was_used():
    """Ray's own handler imports ray.dag at every exit (seconds on a busy host), connected or not."""
    # registered before Ray's handler: runs after it (and after the quick exit's)
    probe = ("import sys, atexit\natexit.register(lambda: print('dag', 'ray.dag' in sys.modules, flush=True))\n"
             "import ray\nfrom dynamo_spec.engine.process_exit import install\ninstall(); install()\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["dag", "False"], out.stdout + out.stderr
    unused = probe.replace("install(); install()", "")  # Ray's handler as Ray registers it: the import
    out = subprocess.run([sys.executable, "-c", unused], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["dag", "True"], out.stdout + out.stderr


@pytest.mark.parametrize("code", [0, 1])
def test_exit_now_keeps_the_code_the_handlers_and_what_was_printed(code):
    probe = ("import atexit, logging, sys\nfrom dynamo_spec.engine.process_exit import exit_now, install\ninstall()\n"
             "atexit.register(lambda: sys.stdout.write('handler\\n'))\n"
             "logging.basicConfig(stream=sys.stderr)\nlogging.getLogger('x').warning('logged')\n"
             "sys.stdout.write('printed\\n')\n"  # buffered: a pipe, no flush
             f"exit_now({code})\nprint('not reached')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == code and out.stdout.split() == ["printed", "handler"], out.stdout + out.stderr
    assert "logged" in out.stderr
