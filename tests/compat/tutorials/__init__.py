"""The RPC tutorials' programs, run under ``asyncrpc.compat`` with only their imports
changed (see docs/compat.md, "The seed tutorials", and tests/compat/test_tutorials.py).

Each program is the tutorial's own code (BSD-3-Clause, see LICENSE here); every line
changed for other reasons than imports carries a ``# compat-test:`` comment.
``stand_ins`` replaces what a CI machine lacks (MNIST downloads, fixed ports).
"""
