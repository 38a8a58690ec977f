"""Named crash points and a full-disk switch for the crash tests: `OCRL_CRASH_AT=<point>[:<n>]` makes the process
SIGKILL itself the n-th time (default 1st) it passes `<point>`. Unset, a crash point costs one
dictionary lookup. The points sit where a real crash hurts most:

- `judging`: a turn's votes are in, its sample is not yet journaled
- `train_step`: the optimizer stepped, the batch is not yet marked consumed
- `swap`: half of the new weights are copied into the serving engine
- `checkpoint`: a checkpoint's weights are written, its state and rename are not
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("OCRL_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
_left = {_point: int(_nth or 1)} if _point else {}


def crash_point(name: str) -> None:
    if name in _left:
        _left[name] -= 1
        if _left[name] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


_disk_full_flag = os.environ.get("OCRL_DISK_FULL_IF", "")


def disk_full() -> bool:
    """`OCRL_DISK_FULL_IF=<path>`: while that file exists, record appends behave as on a full
    disk (a short write, then ENOSPC). Lets the end-to-end tests fill and free the disk."""
    return bool(_disk_full_flag) and os.path.exists(_disk_full_flag)
