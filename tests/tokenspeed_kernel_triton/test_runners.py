"""``tokenspeed_kernel_triton._runners``: the pipeline's classification of launch tensors and
the runner cache's bound, off switch and bind count (launches recorded, nothing runs)."""

import pytest
import torch
from support.launch_recorder import Recorder

from tokenspeed_kernel_triton import _launcher, _runners
from tokenspeed_kernel_triton._launcher import Launch


def _kernel():
    """A stand-in for a kernel object (only its name is read by the recorder)."""

    def probe():
        return None

    return probe


def test_a_view_of_an_input_in_a_launch_is_refused():
    x = torch.zeros(4, 4)
    with pytest.raises(TypeError, match="neither an input"):
        _runners.pipeline([Launch(_kernel(), (1,), (x.view(16),), {})], (x,))


def test_inputs_that_are_one_tensor_are_refused_by_the_pipeline():
    x = torch.zeros(4)
    with pytest.raises(TypeError, match="one object"):
        _runners.pipeline([Launch(_kernel(), (1,), (x,), {})], (x, x))


def test_a_scratch_buffer_must_be_fresh():
    x, buf = torch.zeros(4), torch.empty(8)
    with pytest.raises(TypeError, match="scratch"):
        _runners.pipeline([Launch(_kernel(), (1,), (x, buf[2:]), {})], (x,), scratch=(buf[2:],))


def test_runs_take_their_inputs_new_scratch_and_the_kept_objects(monkeypatch):
    rec = Recorder().install(monkeypatch)
    kernel, kept = _kernel(), torch.zeros(1)

    def build(inputs):
        a, b = inputs
        scratch = torch.empty(3)
        return (
            [Launch(kernel, (2,), (a, scratch, kept, b, 7), {"K": 1}), Launch(kernel, (1,), (scratch, b), {})],
            (scratch,),
            (kept,),
        )

    args = (torch.zeros(2), torch.ones(2))
    run = _runners.bind_runner(build, args, lambda t: t, lambda _, t: t)
    later = (torch.full((2,), 5.0), torch.full((2,), 6.0))
    run(later)
    first, second = rec.launches
    assert first[2][0] is later[0] and first[2][3] is later[1] and first[2][2] is kept and first[2][4] == 7
    assert first[2][1] is second[2][0], "one scratch buffer per run, shared by its launches"
    assert first[2][1].shape == (3,) and second[2][1] is later[1]
    run(later)
    assert rec.launches[2][2][1] is not first[2][1], "a new scratch buffer per run"


def test_the_cache_binds_once_per_key_is_bounded_and_turns_off_with_the_launch_cache(monkeypatch):
    bound, fresh = [], []

    def bind(args):
        bound.append(args)
        return lambda a: None

    cache = _runners.RunnerCache("test_cache", key=lambda a: a % 3, bind=bind, fresh=fresh.append, limit=2)
    try:
        for value in (0, 3, 6, 1, 4):
            cache(value)
        assert bound == [0, 1] and cache.binds == 2 and len(cache.runners) == 2
        cache(2)  # a third key: the full cache is emptied first
        assert len(cache.runners) == 1 and bound[-1] == 2
        monkeypatch.setattr(_launcher, "_enabled", False)
        cache(0)
        assert fresh == [0] and cache.binds == 3
        assert _runners.runner_stats()["test_cache"] == {"runners": 1, "binds": 3}
    finally:
        _runners._CACHES.remove(cache)


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """A derived launch argument: ``x`` viewed as ``n`` rows."""
    return x.view(n, -1)


def test_derived_arguments_are_computed_per_run_from_the_runs_tensors(monkeypatch):
    """A view of an input (declared derived) is computed anew per run from the run's input and
    the bound constants; the runner holds no tensor of the bind call."""
    rec = Recorder().install(monkeypatch)
    kernel = _kernel()

    def build(inputs):
        a, b = inputs
        rows = _runners.derive(_rows, a, 2)
        return [Launch(kernel, (1,), (rows.value, b, a), {})], (), (), (rows,)

    run = _runners.bind_runner(build, (torch.zeros(8), torch.zeros(3)), lambda t: t, lambda _, t: t)
    for _ in range(2):
        later = (torch.randn(8), torch.randn(3))
        run(later)
        got = rec.launches[-1][2]
        assert got[0].shape == (2, 4) and got[0]._base is later[0]
        assert got[1] is later[1] and got[2] is later[0]
    a = torch.zeros(8)
    rows = _runners.derive(_rows, a, 2)
    pipe = _runners.pipeline([Launch(kernel, (1,), (rows.value,), {})], (a,), derived=(rows,))
    ((fn, bound, positions, slots, head),) = pipe._derived
    assert fn is _rows and bound == (None, 2) and positions == (0,) and slots == (0,), "no tensor held"
    assert head is None, "a plain derived value is computed per run, never keyed"


def test_a_derived_value_of_a_foreign_tensor_is_refused():
    a, other = torch.zeros(8), torch.zeros(8)
    rows = _runners.derive(_rows, other, 2)
    with pytest.raises(TypeError, match="_rows: argument 0 of a derived value is a tensor that is neither"):
        _runners.pipeline([Launch(_kernel(), (1,), (rows.value, a), {})], (a,), derived=(rows,))
    buf = torch.empty(8)
    from_scratch = _runners.derive(_rows, buf, 4)  # from a scratch buffer: computed after it per run
    _runners.pipeline(
        [Launch(_kernel(), (1,), (from_scratch.value, a), {})], (a,), scratch=(buf,), derived=(from_scratch,)
    )


def test_a_derived_tma_descriptor_follows_each_runs_tensor(monkeypatch):
    """The Gluon case: a TMA descriptor over an input, rebuilt per run over the run's tensor
    (base, shape and strides its own), with the bound block shape and layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rec = Recorder().install(monkeypatch)
    kernel = _kernel()
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)

    def descriptor(x, rows, layout):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 64], layout)

    def build(inputs):
        (x,) = inputs
        desc = _runners.derive(descriptor, x, 16, layout)
        return [Launch(kernel, (1,), (desc.value, x.shape[0]), {})], (), (), (desc,)

    run = _runners.bind_runner(build, (torch.zeros(32, 64, dtype=torch.bfloat16),), lambda t: t, lambda _, t: t)
    for _ in range(3):
        x = torch.randn(32, 64).to(torch.bfloat16)
        run((x,))
        got = rec.launches[-1][2][0]
        assert got.base is x and got.block_shape == [16, 64] and got.layout is layout and got.shape == [32, 64]
    assert rec.bound == 1


def test_the_generated_run_launches_what_the_generic_one_does(monkeypatch):
    """A pipeline without scratch whose derived values are descriptors over one input each
    runs a generated function (inputs unpacked); it hands every launch what the generic loop
    hands it: at a descriptor's position the run's tensor itself, the launch deriving the
    descriptor (a derived slot: built from the run's tensor, with the bound block shape and
    layout)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rec = Recorder().install(monkeypatch)
    kernel, kept = _kernel(), torch.zeros(1)
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)

    def descriptor(x, rows, layout):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 64], layout)

    def inputs():
        return (*(torch.randn(32, 64).to(torch.bfloat16) for _ in range(2)), torch.zeros(4))

    bind = inputs()
    qd, kd = (_runners.derive_descriptor(descriptor, t, 16, layout) for t in bind[:2])
    launches = [Launch(kernel, (2,), (qd.value, bind[2], kd.value, kept, 9), {}), Launch(kernel, (1,), (bind[2],), {})]
    pipe = _runners.pipeline(launches, bind, keep=(kept,), derived=(qd, kd))
    assert pipe.run != pipe.__call__, "generated"
    for run in (pipe.__call__, pipe.run):
        x = inputs()
        run(x)
        first, second = rec.launches[-2:]
        assert first[2][0].base is x[0] and first[2][2].base is x[1] and first[2][1] is x[2] and first[2][3] is kept
        assert first[2][0].block_shape == [16, 64] and first[2][4] == 9 and second[2] == (x[2],)
    # Both hand the bound launch the run's tensors at the descriptors' positions, nothing built.
    x = inputs()
    pipe.__call__(x)
    pipe.run(x)
    handed = rec.values[-4], rec.values[-2]
    assert all(v[0] is x[0] and v[1] is x[2] and v[2] is x[1] for v in handed)
    with pytest.raises(TypeError, match="expected 3 inputs"):
        pipe.run(bind[:2])
    buf = torch.empty(4)
    with_scratch = _runners.pipeline([Launch(kernel, (1,), (bind[2], buf), {})], bind, scratch=(buf,))
    assert with_scratch.run == with_scratch.__call__, "scratch buffers: the generic loop"
