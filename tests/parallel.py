"""How the suite shares two pytest workers (pytest-xdist; ``./scripts/test.sh`` passes ``-n 2 --dist loadscope``).

Most tests wait: on a tokenmill process to answer, a stream to end, a process to restart. Run one
after the other they left this 2-core machine half idle, so two workers run the test modules side by
side, and a module that waits runs beside one that computes.

* A test module is one unit of work, so its module-scoped servers start once, on one worker.
* The engine modules that use vLLM (tests/engines/*vllm*) share processes slow to start: the vLLM
  servers of tests/vllm_stack.py, vLLM's parsers, the image stack. They are one unit, pinned to the
  first worker, gw0, the only worker that starts them early (conftest's ``pytest_collection_finish``),
  so each loads once, while the other worker runs other modules. conftest checks that every module
  with a ``start_early`` is in that unit.

The unit is chosen by path, not by xdist's ``xdist_group`` mark: with pytest 9.2 the mark no longer
reaches the scheduler (xdist renames ``item._nodeid``, which pytest's ``nodeid`` no longer reads).
"""

from __future__ import annotations

import os

from xdist.scheduler import LoadScopeScheduling

PINNED_UNIT = "vllm"
PINNED_WORKER = "gw0"


def pinned(nodeid: str) -> bool:
    """Whether a test (or module path) belongs to the pinned unit: tests/engines/ modules named for vLLM."""
    folder, _, name = nodeid.split("::", 1)[0].rpartition("/")
    return folder.endswith("tests/engines") and "vllm" in name


def starts_shared_processes() -> bool:
    """Whether this process runs the pinned unit (gw0, or the only process without xdist)."""
    return os.environ.get("PYTEST_XDIST_WORKER") in (None, PINNED_WORKER)


class ModuleScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduling with modules for units and the vLLM modules one unit on gw0."""

    def _split_scope(self, nodeid: str) -> str:
        return PINNED_UNIT if pinned(nodeid) else nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        # gw0 takes the pinned unit before anything else, every other worker what is behind it (gw0 takes
        # it in the first round of assignments, so no other worker is ever left with it alone)
        if PINNED_UNIT in self.workqueue and len(self.workqueue) > 1:
            self.workqueue.move_to_end(PINNED_UNIT, last=node.gateway.id != PINNED_WORKER)
        super()._assign_work_unit(node)
