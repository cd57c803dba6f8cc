"""Shared by dmuon's Python tests: ranks as processes (spawn) in a real torch.distributed Gloo group on
a fresh FileStore per call, and float64 references written from the documented math, not by dmuon."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, store_path, fn, args):
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A passed rank ends without Python's finalisation. torch's Gloo worker threads drop their reference to a
    # finished collective after waking its waiter; when that is the last reference and the tensors have
    # Python objects (FSDP2's all-gathers, DTensor.full_tensor), the decref takes the GIL, and a thread that
    # takes it while the interpreter is finalising is ended with pthread_exit inside a noexcept destructor:
    # std::terminate ("terminate called without an active exception"), a SIGABRT after a passed test. Seen on
    # this 2-core box about once in 15 runs of an FSDP2 test (core dump: the main thread in Py_FinalizeEx, a
    # Gloo worker in ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil -> PyThread_exit_thread).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(tmp_path, world, fn, *args):
    """Runs fn(rank, world, *args) on `world` spawned ranks; a rank's exception fails the caller.
    `fn` must be a module-level function (pickled by name)."""
    store = os.path.join(str(tmp_path), f"store-{world}")
    mp.spawn(_entry, args=(world, store, fn, args), nprocs=world, join=True)


def _fault_entry(rank, world, store_path, fn, args, timeout_s):
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    fn(rank, world, *args)
    os._exit(0)  # no teardown: a peer may be gone or stopped (destroy_process_group could wait for it)


def run_faulty_ranks(tmp_path, world, fn, *args, timeout_s=60, deadline_s=120):
    """Runs fn(rank, world, *args) on `world` processes that may die or stop on purpose (fault tests):
    waits up to deadline_s for every rank that is not stopped, then kills what is left (stopped ranks
    included). Returns the exit codes (None: killed at the deadline)."""
    import signal
    import time

    ctx = mp.get_context("spawn")
    store = os.path.join(str(tmp_path), f"fault-store-{world}")
    procs = [ctx.Process(target=_fault_entry, args=(r, world, store, fn, args, timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    codes = [None] * world
    while time.monotonic() < end and any(c is None for c in codes):
        for r, p in enumerate(procs):
            if codes[r] is None and not p.is_alive():
                codes[r] = p.exitcode
        if all(c is not None or _stopped(p.pid) for c, p in zip(codes, procs)):
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    return codes


def _stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def reference_ns(G, coefficients, eps=1e-7):
    """Direct Newton-Schulz in float64: X = G / (|G|_F + eps), oriented so rows <= cols, then for each
    (a, b, c): A = X X^T, X = a X + (b A + c A A) X; oriented back."""
    X = G.to(torch.float64)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.transpose(-2, -1)
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    for a, b, c in coefficients:
        A = X @ X.transpose(-2, -1)
        X = a * X + (b * A + c * A @ A) @ X
    if transposed:
        X = X.transpose(-2, -1)
    return X


def rel(a, b):
    return float((a.to(torch.float64) - b.to(torch.float64)).norm() / b.to(torch.float64).norm())


def assert_grads_like(model, plain, where, bound=1e-12):
    """Asserts that every gradient this rank holds of dedicated `model` -- each parameter but the dedicated
    matrices other ranks own -- equals `plain`'s (the same module without dmuon, its parameters in the same
    order): max |difference| / max |plain| below `bound`. Returns how many it checked."""
    import dmuon

    theirs = {d.name for d in dmuon.get_dedicated_params(model) if not d.is_owner}
    checked = 0
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if name in theirs:
            continue
        assert p.grad is not None, f"{where}: {name} has no gradient"
        err = float((p.grad - q.grad).abs().max() / q.grad.abs().max())
        assert err < bound, f"{where}: the gradient of {name} differs by {err}"
        checked += 1
    return checked
