"""dmuon's Newton-Schulz from Python: the API reference's names and defaults, results against a float64
reference, errors as Python exceptions, and the column-sharded Gram form over a real Gloo group."""

import collections.abc
import typing
import warnings

import pytest
import torch

import dmuon
from dmuon_testing import reference_ns, rel, run_ranks

PE = dmuon.POLAR_EXPRESS_COEFFICIENTS


def test_import_names_and_version():
    assert dmuon.__version__.count(".") == 2
    for name in dmuon.__all__:
        assert hasattr(dmuon, name), name
        if name[0].isalpha() and typing.get_origin(getattr(dmuon, name)) is None:  # (type aliases have none)
            assert getattr(dmuon, name).__doc__ or name.isupper(), f"{name} has no docstring"
    # the API reference's type aliases of dedicate_params's callables and get_owned_params's rank
    assert typing.get_origin(dmuon.OwnerRankLike) is typing.Union
    for alias in (dmuon.HookBoundaryResolver, dmuon.AssignmentGroupKeyFn, dmuon.RouteHintFn, dmuon.ParamPolicyFn):
        assert typing.get_origin(alias) is collections.abc.Callable
    # DEFAULT_COEFFICIENTS: what the functions use when given none
    G = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert dmuon.DEFAULT_COEFFICIENTS == PE
    for fn in (dmuon.direct_newton_schulz, dmuon.newton_schulz, dmuon.gram_newton_schulz):
        assert torch.equal(fn(G), fn(G, coefficients=dmuon.DEFAULT_COEFFICIENTS)), fn.__name__
    # the reference's YOU coefficients, exactly; Polar Express: 5 triples with the safety factor
    assert dmuon.YOU_COEFFICIENTS[0] == [4.0848, -6.8946, 2.927]
    assert len(dmuon.YOU_COEFFICIENTS) == 5 and len(PE) == 5
    assert all(len(t) == 3 for t in PE)


def test_backend_status_on_cpu():
    s = dmuon.get_backend_status()
    assert s["sm_version"] == 0 and s["device"] == "cpu"
    assert s["auto_choice"] == "cublas" and s["cublas_always_available"] is True
    assert s["quack_available"] is False and s["cute_sm80_available"] is False
    assert [k["name"] for k in s["kernels"]] == ["auto", "cublas", "syrk", "quack", "cute_sm80"]
    line = dmuon.get_ns_backend()
    assert line.startswith("Gram NS · kernel=cpu-gemm (CPU"), line  # on the CPU the plain path is not cuBLAS


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (3, 8, 24)])
def test_functions_match_float64_reference(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape, dtype=torch.float64)
    ref = reference_ns(G, PE)
    # the Gram form equals the direct iteration mathematically: float64 agreement to ~1e-12
    assert rel(dmuon.newton_schulz(G), ref) < 1e-10
    assert rel(dmuon.gram_newton_schulz(G), ref) < 1e-10
    assert rel(dmuon.direct_newton_schulz(G), ref) < 1e-10
    # the Gram-space functions ignore steps (the API reference): len(coefficients) iterations; the direct
    # function and NewtonSchulz.local take it
    for fn in (dmuon.newton_schulz, dmuon.gram_newton_schulz):
        assert torch.equal(fn(G, steps=1), fn(G)) and torch.equal(fn(G, steps=9), fn(G))
        assert torch.equal(fn(G, steps=2, coefficients=dmuon.YOU_COEFFICIENTS), fn(G, coefficients=dmuon.YOU_COEFFICIENTS))
    assert rel(dmuon.direct_newton_schulz(G, steps=3), reference_ns(G, PE[:3])) < 1e-10
    assert rel(dmuon.NewtonSchulz().local(G), ref) < 1e-10
    assert rel(dmuon.NewtonSchulz("direct").local(G, 3), reference_ns(G, PE[:3])) < 1e-10
    you = dmuon.NewtonSchulz("gram", coefficients=dmuon.YOU_COEFFICIENTS)
    assert rel(you.local(G), reference_ns(G, dmuon.YOU_COEFFICIENTS)) < 1e-10
    # the function and the object are one code path: bit for bit
    assert torch.equal(dmuon.newton_schulz(G), dmuon.NewtonSchulz().local(G))
    assert dmuon.newton_schulz(G).dtype == torch.float64 and dmuon.newton_schulz(G).shape == G.shape


def test_float32_within_measured_bound():
    torch.manual_seed(1)
    G = torch.randn(64, 256)
    err = rel(dmuon.newton_schulz(G), reference_ns(G, PE))
    # fp32 iteration against float64: measured ~1e-6 here; bound 1e-4 (100x margin)
    assert err < 1e-4, err
    assert dmuon.newton_schulz(G).dtype == torch.float32


def test_gram_factors_reproduce_gram_ns():
    torch.manual_seed(2)
    G = torch.randn(24, 40, dtype=torch.float64)
    segments, transposed, normalizer = dmuon.gram_newton_schulz_factors(G, restart_iterations=[2, 4])
    assert isinstance(segments, tuple) and len(segments) == 3 and transposed is False
    assert torch.allclose(normalizer, G.norm() + 1e-7, rtol=0, atol=1e-12)
    X = G / normalizer
    for Q in segments:
        X = Q @ X
    assert rel(X, dmuon.gram_newton_schulz(G, restart_iterations=[2, 4])) < 1e-12
    same = dmuon.gram_newton_schulz_q(G, restart_iterations=[2, 4])
    assert all(torch.equal(a, b) for a, b in zip(same[0], segments))


def test_kernels_and_deterministic():
    torch.manual_seed(3)
    G = torch.randn(32, 80, dtype=torch.float64)
    assert dmuon.NewtonSchulz(deterministic=True).kernel == "cublas"
    with pytest.warns(UserWarning, match='kernel="syrk" was given explicitly; the explicit kernel wins'):
        assert dmuon.NewtonSchulz(kernel="syrk", deterministic=True).kernel == "syrk"
    with warnings.catch_warnings():  # warnings as errors: the constructor's own error still wins, no abort
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="restart iteration 7"):
            dmuon.NewtonSchulz(kernel="syrk", deterministic=True, coefficients=[(1.0, 2.0, 3.0)], restart_iterations=[7])
    assert dmuon.NewtonSchulz(kernel="cublas").describe() == "Gram NS · kernel=cpu-gemm"
    assert dmuon.NewtonSchulz().describe("cuda") == "Gram NS · kernel=cublas"
    syrk = dmuon.NewtonSchulz(kernel="syrk").local(G)
    assert rel(syrk, dmuon.NewtonSchulz(kernel="cublas").local(G)) < 1e-12
    assert torch.equal(dmuon.gram_newton_schulz(G, deterministic=True), dmuon.NewtonSchulz(kernel="cublas").local(G))


def test_caller_mistakes_are_python_exceptions():
    with pytest.raises(ValueError, match="kernel 'quack' is not in this build"):
        dmuon.NewtonSchulz(kernel="quack")
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        dmuon.NewtonSchulz(kernel="fast")
    with pytest.raises(ValueError, match="unknown backend 'spectral'"):
        dmuon.NewtonSchulz("spectral")
    with pytest.raises(ValueError, match="expected a matrix"):
        dmuon.newton_schulz(torch.ones(5))
    with pytest.raises(ValueError, match="is all zeros and eps is 0"):  # 0/0 would be NaN
        dmuon.newton_schulz(torch.zeros(3, 4), eps=0)
    with pytest.raises(ValueError, match="invalid steps"):
        dmuon.direct_newton_schulz(torch.ones(3, 4), steps=0)
    with pytest.raises(ValueError, match="restart iteration 7"):
        dmuon.gram_newton_schulz(torch.ones(3, 4), restart_iterations=[7])
    with pytest.raises(TypeError):  # a coefficient triple of two numbers
        dmuon.newton_schulz(torch.ones(3, 4), coefficients=[[1.0, 2.0]])
    try:
        dmuon.newton_schulz(torch.ones(5))
    except ValueError as e:  # dmuon's message, no C++ backtrace
        assert "Exception raised from" not in str(e) and "frame #" not in str(e)


def _distributed_shard(rank, world, G, transposed, batched):
    import torch.distributed as dist

    cols = G.shape[-2] if transposed else G.shape[-1]
    width = cols // world
    sl = slice(rank * width, (rank + 1) * width)
    local = G[..., sl, :] if transposed else G[..., :, sl]
    fn = dmuon.gram_newton_schulz_distributed_local_batched if batched else dmuon.gram_newton_schulz_distributed_local
    out = fn(local.contiguous(), None, transposed=transposed)
    full = dmuon.gram_newton_schulz(G)
    want = full[..., sl, :] if transposed else full[..., :, sl]
    err = rel(out, want)
    assert err < 1e-10, f"rank {rank}: column-sharded Gram NS differs from the full matrix's by {err}"
    # a sub-group of one rank is its own world: the full matrix's NS
    if rank == 0:
        one = dist.new_group([0])
        assert rel(fn(G, one, transposed=transposed), full) < 1e-10
    else:
        dist.new_group([0])  # new_group is collective over the world


@pytest.mark.parametrize("transposed,batched", [(False, False), (True, False), (False, True)])
def test_distributed_local_over_gloo_equals_full_ns(tmp_path, transposed, batched):
    torch.manual_seed(4)
    shape = (48, 16) if transposed else (16, 48)
    G = torch.randn(*((3,) + shape if batched else shape), dtype=torch.float64)
    run_ranks(tmp_path, 2, _distributed_shard, G, transposed, batched)
