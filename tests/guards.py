"""The one time limit the tests allow: a guard against a subprocess that hangs forever.

No test asserts how long anything takes (a loaded machine would break it). A subprocess that could hang (a
deadlock, a prompt, a browser that never exits) gets ``timeout=HANG_GUARD_S``: an hour, at least ten times what the
slowest of them (the documentation's code blocks, a few minutes on a loaded two-core machine) normally takes, so it
only ends a run that would otherwise never end.
"""

HANG_GUARD_S = 3600
