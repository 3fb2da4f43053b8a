"""Data-dependent arguments of reference ops (tapml/op_bounds.py), fast tier.

The vocabulary is walked as torch lists it: every tensor argument name of every op in it is
classified, every op taking an index argument has a check (or is out of the vocabulary), and every
check is fuzzed here with out-of-range values (below the range, = the size, huge) on a real sample
call that torch runs. Bad values must be refused before the op runs, never reach the kernel.
"""

import textwrap

import pytest
import torch

from tapml.meta_sizes import check_graph_sizes, guard_call
from tapml.op_bounds import (BOUNDS, INDEX_ARGUMENTS, OTHER_INDEX_OPS, VALUE_ARGUMENTS, VALUE_TARGET_OPS, OutOfBounds,
                             bind)
from tapml.ops import check_op, resolve_op

HUGE = 1 << 40


def vocabulary() -> list[str]:
    """Every aten overload torch has that passes tapml.ops.check_op."""
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            names.add(f"aten.{schema.name[6:]}.{schema.overload_name or 'default'}")
    ok = []
    for name in sorted(names):
        try:
            check_op(name)
        except ValueError:
            continue
        ok.append(name)
    return ok


@pytest.fixture(scope="module")
def vocab():
    return vocabulary()


def _tensor_args(op):
    return [a.name for a in op._schema.arguments if "Tensor" in str(a.type)]


def test_every_tensor_argument_of_the_vocabulary_is_classified(vocab):
    assert len(vocab) > 800
    unknown = {(name, a) for name in vocab for a in _tensor_args(resolve_op(name))
               if a not in INDEX_ARGUMENTS | VALUE_ARGUMENTS}
    assert not unknown, f"classify these tensor arguments in tapml/op_bounds.py: {sorted(unknown)[:20]}"
    assert not INDEX_ARGUMENTS & VALUE_ARGUMENTS


def test_every_op_taking_indices_is_checked_or_refused(vocab):
    unchecked = []
    for name in vocab:
        packet = name.rsplit(".", 1)[0]
        index_args = [a for a in _tensor_args(resolve_op(name)) if a in INDEX_ARGUMENTS
                      and not (a == "target" and packet in VALUE_TARGET_OPS)]
        if (index_args or packet in OTHER_INDEX_OPS) and packet not in BOUNDS:
            unchecked.append((name, index_args))
    assert not unchecked, f"ops taking indices without a check in tapml.op_bounds.BOUNDS: {unchecked[:20]}"
    packets = {n.rsplit(".", 1)[0] for n in vocab}
    assert set(BOUNDS) <= packets, f"checks for ops outside the vocabulary: {sorted(set(BOUNDS) - packets)}"


@pytest.mark.parametrize("name", ["aten.sparse_coo_tensor.indices", "aten.sparse_csr_tensor.crow_col_value",
                                  "aten.fbgemm_linear_int8_weight.default", "aten.quantize_per_tensor.default",
                                  "aten.lstm.data", "aten.gru.data", "aten.quantized_lstm.input",
                                  "aten.embedding_sparse_backward.default", "aten.miopen_ctc_loss.Tensor",
                                  "aten.mkldnn_max_pool2d_backward.default"])
def test_ops_whose_data_cannot_be_checked_are_out_of_the_vocabulary(name):
    with pytest.raises(ValueError, match="trusts indices or packed data"):
        check_op(name)


# --- one real call per checked op, and where its index values live -------------------------------

def _samples():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    def i(values):
        return torch.tensor(values, dtype=torch.long)

    x = r(3, 4)
    idx2 = i([[0, 1], [2, 3], [1, 0]])
    img = r(1, 1, 4, 4)
    out2, ind2 = torch.ops.aten.max_pool2d_with_indices.default(img, [2, 2], [2, 2])
    vol = r(1, 1, 2, 4, 4)
    out3, ind3 = torch.ops.aten.max_pool3d_with_indices.default(vol, [2, 2, 2], [2, 2, 2])
    aout2, aind2 = torch.ops.aten.adaptive_max_pool2d.default(img, [2, 2])
    aout3, aind3 = torch.ops.aten.adaptive_max_pool3d.default(vol, [1, 2, 2])
    samples2 = torch.rand(1, 1, 2, generator=g)
    fout2, find2 = torch.ops.aten.fractional_max_pool2d.default(img, [2, 2], [2, 2], samples2)
    cube = r(1, 1, 4, 4, 4)
    samples3 = torch.rand(1, 1, 3, generator=g)
    fout3, find3 = torch.ops.aten.fractional_max_pool3d.default(cube, [2, 2, 2], [2, 2, 2], samples3)
    logp = torch.log_softmax(r(3, 5), 1)
    logp4 = torch.log_softmax(r(2, 5, 3, 3), 1)
    t3 = i([0, 4, 2])
    t4 = torch.randint(0, 5, (2, 3, 3), generator=g)
    ml_target = i([[3, 0, -1, 1, 2], [4, -1, 0, 0, 0], [1, 2, 3, 4, -1]])
    ctc_lp = torch.log_softmax(r(6, 2, 4), 2)
    a = r(3, 3)
    lu, piv = torch.linalg.lu_factor(a)
    ld, ldl_piv = torch.linalg.ldl_factor(a @ a.T)
    seq = torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0])
    bag = dict(weight=r(5, 3), indices=i([0, 4, 1]), offsets=i([0, 2]))
    _, cummax_idx = torch.cummax(x, 1)
    a_ = torch.ops.aten
    # (op, args, kwargs, (argument, position in a list or None), lowest allowed, highest allowed + 1)
    return [
        ("aten.gather.default", [x, 1, idx2], {}, ("index", None), 0, 4),
        ("aten.scatter.src", [x, 1, idx2, r(3, 2)], {}, ("index", None), 0, 4),
        ("aten.scatter.value", [x, 1, idx2, 2.0], {}, ("index", None), 0, 4),
        ("aten.scatter_add.default", [x, 1, idx2, r(3, 2)], {}, ("index", None), 0, 4),
        ("aten.scatter_reduce.two", [x, 1, idx2, r(3, 2), "sum"], {}, ("index", None), 0, 4),
        ("aten.gather_backward.default", [r(3, 2), x, 1, idx2, False], {}, ("index", None), 0, 4),
        ("aten.index_select.default", [x, 0, i([0, 2])], {}, ("index", None), 0, 3),
        ("aten.index_add.default", [x, 0, i([0, 2]), r(2, 4)], {}, ("index", None), 0, 3),
        ("aten.index_copy.default", [x, 0, i([0, 2]), r(2, 4)], {}, ("index", None), 0, 3),
        ("aten.index_reduce.default", [x, 0, i([0, 2]), r(2, 4), "prod"], {}, ("index", None), 0, 3),
        ("aten.index_fill.int_Scalar", [x, 0, i([0, 2]), 1.5], {}, ("index", None), -3, 3),
        ("aten.index_select_backward.default", [r(2, 4), [3, 4], 0, i([0, 2])], {}, ("index", None), 0, 3),
        ("aten.index.Tensor", [x, [i([0, 2])]], {}, ("indices", 0), -3, 3),
        ("aten._unsafe_index.Tensor", [x, [None, i([0, 3])]], {}, ("indices", 1), -4, 4),
        ("aten.index_put.default", [x, [i([0, 2])], r(2, 4)], {}, ("indices", 0), -3, 3),
        ("aten.take.default", [x, i([0, 5])], {}, ("index", None), -12, 12),
        ("aten.put.default", [x, i([0, 5]), r(2)], {}, ("index", None), -12, 12),
        ("aten.take_along_dim.default", [x, idx2, 1], {}, ("indices", None), 0, 4),
        ("aten.embedding.default", [r(5, 3), i([0, 4])], {}, ("indices", None), 0, 5),
        ("aten.embedding_renorm.default", [r(5, 3), i([0, 4]), 1.0, 2.0], {}, ("indices", None), 0, 5),
        ("aten.embedding_backward.default", [r(2, 3), i([0, 4]), 5, -1, False, False], {}, ("indices", None), 0, 5),
        ("aten.embedding_dense_backward.default", [r(2, 3), i([0, 4]), 5, -1, False], {}, ("indices", None), 0, 5),
        ("aten.embedding_bag.default", [bag["weight"], bag["indices"], bag["offsets"]], {}, ("indices", None), 0, 5),
        ("aten._embedding_bag.default", [bag["weight"], bag["indices"], bag["offsets"]], {}, ("indices", None), 0, 5),
        ("aten._embedding_bag_forward_only.default", [bag["weight"], bag["indices"], bag["offsets"]], {},
         ("offsets", None), 0, 4),
        ("aten.max_pool2d_with_indices_backward.default",
         [torch.ones_like(out2), img, [2, 2], [2, 2], [0, 0], [1, 1], False, ind2], {}, ("indices", None), 0, 16),
        ("aten.max_pool3d_with_indices_backward.default",
         [torch.ones_like(out3), vol, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, ind3], {},
         ("indices", None), 0, 32),
        ("aten.adaptive_max_pool2d_backward.default", [torch.ones_like(aout2), img, aind2], {}, ("indices", None), 0, 16),
        ("aten.adaptive_max_pool3d_backward.default", [torch.ones_like(aout3), vol, aind3], {}, ("indices", None), 0, 32),
        ("aten.fractional_max_pool2d_backward.default", [torch.ones_like(fout2), img, [2, 2], [2, 2], find2], {},
         ("indices", None), 0, 16),
        ("aten.fractional_max_pool3d_backward.default", [torch.ones_like(fout3), cube, [2, 2, 2], [2, 2, 2], find3], {},
         ("indices", None), 0, 64),
        ("aten.max_unpool2d.default", [out2, ind2, [4, 4]], {}, ("indices", None), 0, 16),
        ("aten.max_unpool3d.default", [out3, ind3, [2, 4, 4], [2, 2, 2], [0, 0, 0]], {}, ("indices", None), 0, 32),
        ("aten.value_selecting_reduction_backward.default", [r(3), 1, i([0, 3, 1]), [3, 4], False], {},
         ("indices", None), 0, 4),
        ("aten.cummaxmin_backward.default", [torch.ones_like(x), x, cummax_idx, 1], {}, ("indices", None), 0, 4),
        ("aten.nll_loss.default", [logp, t3], {}, ("target", None), 0, 5),
        ("aten.nll_loss_nd.default", [logp, t3], {}, ("target", None), 0, 5),
        ("aten.nll_loss2d.default", [logp4, t4], {}, ("target", None), 0, 5),
        ("aten.nll_loss_forward.default", [logp, t3, None, 1, -100], {}, ("target", None), 0, 5),
        ("aten.nll_loss2d_forward.default", [logp4, t4, None, 1, -100], {}, ("target", None), 0, 5),
        ("aten.nll_loss_backward.default", [torch.tensor(1.0), logp, t3, None, 1, -100, torch.tensor(3.0)], {},
         ("target", None), 0, 5),
        ("aten.nll_loss2d_backward.default", [torch.tensor(1.0), logp4, t4, None, 1, -100, torch.tensor(18.0)], {},
         ("target", None), 0, 5),
        ("aten.cross_entropy_loss.default", [r(3, 5), t3], {}, ("target", None), 0, 5),
        ("aten.multi_margin_loss.default", [r(3, 5), t3], {}, ("target", None), 0, 5),
        ("aten.multi_margin_loss_backward.default", [torch.tensor(1.0), r(3, 5), t3, 1, 1.0, None, 1], {},
         ("target", None), 0, 5),
        ("aten.multilabel_margin_loss.default", [r(3, 5), ml_target], {}, ("target", None), -1, 5),
        ("aten.multilabel_margin_loss_forward.default", [r(3, 5), ml_target, 1], {}, ("target", None), -1, 5),
        ("aten.multilabel_margin_loss_backward.default",
         [torch.tensor(1.0), r(3, 5), ml_target, 1, torch.zeros(3, 5)], {}, ("target", None), -1, 5),
        ("aten.ctc_loss.IntList", [ctc_lp, i([[1, 2, 3], [3, 1, 0]]), [6, 6], [3, 2]], {}, ("targets", None), 0, 4),
        ("aten.ctc_loss.Tensor", [ctc_lp, i([1, 2, 3, 3, 1]), i([6, 5]), i([3, 2])], {}, ("targets", None), 0, 4),
        ("aten.searchsorted.Tensor", [seq, r(3)], {"sorter": i([1, 3, 2, 4, 0])}, ("sorter", None), 0, 5),
        ("aten.bincount.default", [i([0, 3, 1])], {}, ("self", None), 0, None),
        ("aten.one_hot.default", [i([0, 2]), 3], {}, ("self", None), 0, 3),
        ("aten.repeat_interleave.Tensor", [i([1, 2])], {}, ("repeats", None), 0, None),
        ("aten.repeat_interleave.self_Tensor", [r(3), i([1, 2, 0])], {}, ("repeats", None), 0, None),
        ("aten.narrow.Tensor", [x, 1, torch.tensor(1), 2], {}, ("start", None), -4, 3),
        ("aten.lu_unpack.default", [lu, piv], {}, ("LU_pivots", None), 1, 4),
        ("aten.lu_solve.default", [r(3, 1), lu, piv], {}, ("LU_pivots", None), 1, 4),
        ("aten.linalg_lu_solve.default", [lu, piv, r(3, 1)], {}, ("pivots", None), 1, 4),
        ("aten.linalg_ldl_solve.default", [ld, ldl_piv, r(3, 1)], {}, ("pivots", None), 1, 4),
        ("aten.segment_reduce.default", [r(6), "sum"], {"lengths": i([2, 4])}, ("lengths", None), 0, 7),
        # checked by shape or mode, not by index values (below)
        ("aten.tensor_split.tensor_indices_or_sections", [r(6), i([2, 4])], {}, None, None, None),
        ("aten.as_strided.default", [x, [2, 2], [4, 1], 0], {}, None, None, None),
        ("aten.as_strided_copy.default", [x, [2, 2], [4, 1], 0], {}, None, None, None),
        ("aten.as_strided_scatter.default", [x, r(2, 2), [2, 2], [4, 1], 0], {}, None, None, None),
        ("aten.fractional_max_pool2d.default", [img, [2, 2], [2, 2], samples2], {}, None, None, None),
        ("aten.fractional_max_pool3d.default", [cube, [2, 2, 2], [2, 2, 2], samples3], {}, None, None, None),
        ("aten.grid_sampler.default", [img, r(1, 2, 2, 2).clamp(-1, 1), 0, 0, False], {}, None, None, None),
        ("aten.grid_sampler_2d.default", [img, r(1, 2, 2, 2).clamp(-1, 1), 0, 0, False], {}, None, None, None),
        ("aten.grid_sampler_3d.default", [vol, r(1, 2, 2, 2, 3).clamp(-1, 1), 0, 0, False], {}, None, None, None),
        ("aten.grid_sampler_2d_backward.default",
         [r(1, 1, 2, 2), img, r(1, 2, 2, 2).clamp(-1, 1), 0, 0, False, [True, True]], {}, None, None, None),
        ("aten.grid_sampler_3d_backward.default",
         [r(1, 1, 2, 2, 2), vol, r(1, 2, 2, 2, 3).clamp(-1, 1), 0, 0, False, [True, True]], {}, None, None, None),
    ], a_


SAMPLES, _ = _samples()


def test_every_check_has_a_sample():
    sampled = {name.rsplit(".", 1)[0] for name, *_ in SAMPLES}
    assert set(BOUNDS) <= sampled, f"no fuzz sample for {sorted(set(BOUNDS) - sampled)}"


def _set(args, kwargs, op, where, value):
    """A copy of the call with argument ``where`` = (name, list position) replaced by ``value``."""
    name, pos = where
    names = [a.name for a in op._schema.arguments]
    args, kwargs = list(args), dict(kwargs)
    k = names.index(name)
    if k < len(args):
        old = args[k]
        args[k] = value if pos is None else [value if j == pos else v for j, v in enumerate(old)]
    else:
        old = kwargs[name]
        kwargs[name] = value if pos is None else [value if j == pos else v for j, v in enumerate(old)]
    return args, kwargs


def _current(args, kwargs, op, where):
    return bind(op, args, kwargs)[where[0]] if where[1] is None else bind(op, args, kwargs)[where[0]][where[1]]


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setenv("TAPML_MEMORY_BUDGET_MIB", "64")


@pytest.mark.parametrize("sample", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_valid_call_passes_and_out_of_range_values_are_refused(sample, figure):
    name, args, kwargs, where, lo, hi = sample
    op = resolve_op(name)
    guard_call(name, args, kwargs)
    op(*args, **kwargs)  # the sample is a real call torch runs
    if where is None:
        return
    base = _current(args, kwargs, op, where)
    # the same call as a one-node graph on the reference platform, the way replay runs a case
    from tapml.errors import PlatformError
    from tapml.platforms.reference import ReferencePlatform
    from tapml.platforms.wgsl.registry import case_graph
    graph, inputs = case_graph(name, args, kwargs)
    slot = next(i for i, t in enumerate(inputs) if t is base)
    platform = ReferencePlatform()
    program = platform.compile(graph)
    tried = 0
    for bad in (lo - 1, hi, HUGE, -HUGE):
        if bad is None:
            continue
        for position in {0, base.numel() - 1}:
            t = base.clone().long()  # pivots are int32; the huge values need 64 bits
            t.view(-1)[position] = bad
            a, k = _set(args, kwargs, op, where, t)
            with pytest.raises(OutOfBounds, match=name.replace(".", r"\.")):
                guard_call(name, a, k)
            # refused before the kernel (just shown): safe to hand to the platform, an error verdict
            with pytest.raises(PlatformError, match=name.replace(".", r"\.")):
                platform.run(program, [t if i == slot else x for i, x in enumerate(inputs)])
            tried += 1
    figure(f"out-of-range values refused, also as a reference case ({name})", tried)


def _sample(name):
    return next(s for s in SAMPLES if s[0] == name)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.__setitem__(1, [4, 4]), "reaches element"),
    (lambda a: a.__setitem__(3, 100), "reaches element"),
    (lambda a: a.__setitem__(2, [-4, 1]), "integers >= 0"),
    (lambda a: a.__setitem__(3, -1), "storage_offset"),
])
@pytest.mark.parametrize("name", ["aten.as_strided.default", "aten.as_strided_copy.default"])
def test_as_strided_beyond_the_storage_is_refused(name, change, match):
    args = list(_sample(name)[1])
    change(args)
    with pytest.raises(OutOfBounds, match=match):
        guard_call(name, args, {})


def test_as_strided_scatter_beyond_self_is_refused():
    name, args, *_ = _sample("aten.as_strided_scatter.default")
    with pytest.raises(OutOfBounds, match="reaches element"):
        guard_call(name, [args[0], torch.zeros(4, 4), [4, 4], [4, 1], 0], {})
    # a view's storage is larger than the copy the op writes into: the copy is what counts
    view = torch.zeros(8, 4)[4:]
    with pytest.raises(OutOfBounds, match="the copy of self holds 16"):
        guard_call(name, [view, torch.zeros(5, 4), [5, 4], [4, 1]], {})
    guard_call(name, [view, torch.zeros(4, 4), [4, 4], [4, 1]], {})


@pytest.mark.parametrize("name", ["aten.fractional_max_pool2d.default", "aten.fractional_max_pool3d.default"])
@pytest.mark.parametrize("value", [-0.5, 1.0, 1e30, float("nan")])
def test_fractional_pool_samples_outside_unit_interval_are_refused(name, value):
    _, args, *_ = _sample(name)
    samples = args[3].clone()
    samples.view(-1)[0] = value
    with pytest.raises(OutOfBounds, match=r"\[0, 1\)"):
        guard_call(name, [*args[:3], samples], {})


@pytest.mark.parametrize("name", [s[0] for s in SAMPLES if "grid_sampler" in s[0]])
def test_grid_sampler_modes_and_non_finite_grids_are_refused(name):
    _, args, kwargs, *_ = _sample(name)
    op = resolve_op(name)
    for mode in ("interpolation_mode", "padding_mode"):
        with pytest.raises(OutOfBounds, match=mode):
            guard_call(name, *_set(args, kwargs, op, (mode, None), 7))
    grid = bind(op, args, kwargs)["grid"].clone()
    grid.view(-1)[0] = float("nan")
    with pytest.raises(OutOfBounds, match="NaN"):
        guard_call(name, *_set(args, kwargs, op, ("grid", None), grid))


def test_ctc_lengths_and_blank_out_of_range_are_refused():
    name, args, *_ = _sample("aten.ctc_loss.IntList")
    for i, value, match in ((2, [7, 6], "input_lengths"), (2, [-1, 6], "input_lengths"), (3, [4, 2], "targets"),
                            (3, [-1, 2], "target_lengths"), (3, [HUGE, 2], "targets"), (2, [6], "batch")):
        bad = list(args)
        bad[i] = value
        with pytest.raises(OutOfBounds, match=match):
            guard_call(name, bad, {})
    with pytest.raises(OutOfBounds, match="blank"):
        guard_call(name, [*args, 4], {})
    name, args, *_ = _sample("aten.ctc_loss.Tensor")
    bad = list(args)
    bad[3] = torch.tensor([3, 3])
    with pytest.raises(OutOfBounds, match="sum to 6"):
        guard_call(name, bad, {})


def test_embedding_bag_offsets_and_segment_lengths_are_refused():
    name, args, *_ = _sample("aten._embedding_bag.default")
    for offsets in ([1, 2], [0, 4], [0, 2, 1], [], [0, HUGE]):
        with pytest.raises(OutOfBounds, match="offsets"):
            guard_call(name, [args[0], args[1], torch.tensor(offsets, dtype=torch.long)], {})
    with pytest.raises(OutOfBounds, match="mode"):
        guard_call(name, [*args, False, 7], {})
    name, args, kwargs, *_ = _sample("aten.segment_reduce.default")
    for lengths in ([2, 3], [3, 4], [-1, 7]):
        with pytest.raises(OutOfBounds, match="lengths"):
            guard_call(name, args, {"lengths": torch.tensor(lengths)})
    with pytest.raises(OutOfBounds, match="offsets"):
        guard_call(name, args, {"offsets": torch.tensor([1, 6])})


def test_data_sized_outputs_are_held_to_the_budget():
    with pytest.raises(OutOfBounds, match="memory budget"):
        guard_call("aten.bincount.default", [torch.tensor([0, 20_000_000])], {})
    with pytest.raises(OutOfBounds, match="memory budget"):
        guard_call("aten.repeat_interleave.Tensor", [torch.tensor([1, 20_000_000])], {})
    with pytest.raises(OutOfBounds, match="memory budget"):
        guard_call("aten.one_hot.default", [torch.tensor([0, 20_000_000])], {})
    with pytest.raises(OutOfBounds, match="output_size"):
        guard_call("aten.repeat_interleave.Tensor", [torch.tensor([1, 2])], {"output_size": 1})
    with pytest.raises(OutOfBounds, match="memory budget"):
        guard_call("aten.full.default", [[1 << 29], 1.0], {"device": torch.device("cpu")})
    with pytest.raises(OutOfBounds, match="tensor_indices_or_sections"):
        guard_call("aten.tensor_split.tensor_indices_or_sections", [torch.zeros(6), torch.zeros(2, 2, dtype=torch.long)], {})


def test_reference_platform_refuses_before_the_kernel_runs():
    """The max-pool backward that wrote out of bounds (issue 26): through the reference platform
    it is a PlatformError (an ``error`` verdict), the kernel never runs."""
    from tapml.errors import PlatformError
    from tapml.graph import Graph, Node, TensorMeta
    from tapml.platforms.reference import ReferencePlatform
    name, args, *_ = _sample("aten.max_pool2d_with_indices_backward.default")
    grad, img, *rest, indices = args
    node = Node("mpb", name, [{"ref": "g"}, {"ref": "x"}, *rest, {"ref": "i"}], {},
                [TensorMeta.of(img)])
    graph = Graph([("g", TensorMeta.of(grad)), ("x", TensorMeta.of(img)), ("i", TensorMeta.of(indices))], [node], ["mpb"])
    platform = ReferencePlatform()
    program = platform.compile(graph)
    bad = indices.clone()
    bad.view(-1)[0] = 1 << 30
    assert platform.run(program, [grad, img, indices])[0].shape == img.shape
    with pytest.raises(PlatformError, match="outside"):
        platform.run(program, [grad, img, bad])


def test_declared_sizes_are_held_to_what_the_op_computes(monkeypatch):
    from tapml.graph import Graph, Node, TensorMeta
    node = Node("full", "aten.full.default", [[1 << 29], 1.0], {"dtype": {"dtype": "float32"}, "device": {"device": "cpu"}},
                [TensorMeta((1,), "float32")])
    with pytest.raises(ValueError, match="node 'full'.*float32\\[536870912\\]"):
        check_graph_sizes(Graph([], [node], ["full"]), budget=1 << 40)
    with pytest.raises(ValueError, match="memory budget"):
        check_graph_sizes(Graph([], [Node("full", "aten.full.default", [[1 << 29], 1.0], {},
                                          [TensorMeta((1 << 29,), "float32")])], ["full"]), budget=1 << 20)
    monkeypatch.delenv("TAPML_MEMORY_BUDGET_MIB")  # the default: half of this machine's memory, far below 4 TiB
    with pytest.raises(ValueError, match="memory budget"):
        check_graph_sizes(Graph([], [Node("full", "aten.full.default", [[1 << 40], 1.0], {},
                                          [TensorMeta((1 << 40,), "float32")])], ["full"]))
    ok = Node("full", "aten.full.default", [[4], 1.0], {}, [TensorMeta((4,), "float32")])
    assert check_graph_sizes(Graph([], [ok], ["full"])) == 16


@pytest.mark.parametrize("args, kwargs", [
    ([{"ref": "x"}, "text"], {}),
    ([{"ref": "x"}], {}),
    ([{"ref": "x"}, {"ref": "x"}], {"bogus": 1}),
    ([{"ref": "x"}, {"ref": "x"}, {"ref": "x"}, {"ref": "x"}], {}),
    ([{"ref": "x"}, [1, [2]]], {}),
])
def test_arguments_outside_the_schema_name_the_node(args, kwargs):
    from tapml.graph import Graph, Node, TensorMeta
    node = Node("add_1", "aten.add.Tensor", args, kwargs, [TensorMeta((3,), "float32")])
    with pytest.raises(ValueError, match="node 'add_1' \\(aten.add.Tensor\\): its arguments do not fit"):
        check_graph_sizes(Graph([("x", TensorMeta((3,), "float32"))], [node], ["add_1"]))


@pytest.mark.slow
def test_the_registry_samples_of_checked_ops_pass_their_checks():
    """Every sample the WGSL registry has for an op with a check (real inputs of the device tests)
    passes it and the meta-device size check: the checks refuse only what the ops refuse."""
    from tapml.graph import run_graph
    from tapml.platforms.wgsl import load_lowerings
    from tapml.platforms.wgsl.registry import sample_cases
    checked = [op for op in load_lowerings() if op.rsplit(".", 1)[0] in BOUNDS]
    assert len(checked) >= 25
    ran = 0
    for op in checked:
        for graph, inputs in sample_cases(op):
            check_graph_sizes(graph)
            run_graph(graph, {r: t for (r, _), t in zip(graph.inputs, inputs)})
            ran += 1
    assert ran > 100


@pytest.mark.parametrize("env, value", [("TAPML_MEMORY_BUDGET_MIB", "x"), ("TAPML_MEMORY_BUDGET_MIB", "0"),
                                        ("TAPML_REFERENCE_MEMORY_MIB", "abc"), ("TAPML_REFERENCE_MEMORY_MIB", "-3")])
def test_bad_budget_settings_say_what_to_fix(monkeypatch, env, value):
    from tapml.errors import TapmlError
    from tapml.driving.targets import open_reference
    monkeypatch.setenv(env, value)
    with pytest.raises(TapmlError, match=f"{env}=.*give a positive number of MiB"):
        open_reference("reference")


def test_the_size_check_of_a_fresh_process_leaves_torch_dynamo_unimported_and_export_still_works():
    """Opening a store checks its sizes on the meta device; torch's Python meta kernels would import
    ``torch._dynamo`` there (over a second of CPU for every command). The check still refuses what it
    must, Dynamo is not imported, and a later ``torch.export`` in the same process works as usual."""
    import subprocess
    import sys
    code = textwrap.dedent('''
        import sys, torch
        from tapml.graph import Graph, Node, TensorMeta
        from tapml.meta_sizes import check_graph_sizes
        # aten.add.Tensor's meta kernel is torch's Python reference, wrapped by _disable_dynamo (the
        # next test shows that it imports torch._dynamo without the stand-in)
        a, b = ("a", TensorMeta((64, 512, 64), "float32")), ("b", TensorMeta((64, 512, 64), "float32"))
        good = Node("add", "aten.add.Tensor", [{"ref": "a"}, {"ref": "b"}], {}, [TensorMeta((64, 512, 64), "float32")])
        assert check_graph_sizes(Graph([a, b], [good], ["add"])) == 8 << 20
        lying = Node("add", "aten.add.Tensor", [{"ref": "a"}, {"ref": "b"}], {}, [TensorMeta((1,), "float32")])
        try:
            check_graph_sizes(Graph([a, b], [lying], ["add"]))
            raise SystemExit("a node declaring less than it computes passed")
        except ValueError as e:
            assert "node 'add'" in str(e), e
        assert "torch._dynamo" not in sys.modules and "_dynamo" not in torch.__dict__
        ep = torch.export.export(torch.nn.Embedding(10, 4), (torch.tensor([[1, 2]]),))
        assert "torch._dynamo" in sys.modules and type(sys.modules["torch._dynamo"]).__name__ == "module"
        assert check_graph_sizes(Graph([a, b], [good], ["add"])) == 8 << 20 and len(ep.graph.nodes) > 2
        print("ok")
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_kernel_that_needs_more_of_torch_dynamo_than_disable_gets_the_real_module():
    """A meta kernel that asks the stand-in for anything but ``disable`` (a later torch may) is
    recorded, and from then on the process checks sizes with the real ``torch._dynamo``."""
    import subprocess
    import sys
    code = textwrap.dedent('''
        import sys
        from tapml import meta_sizes
        from tapml.graph import Graph, Node, TensorMeta
        with meta_sizes._dynamo_left_unimported() as asked:
            import torch._dynamo as stand_in
            assert not hasattr(stand_in, "is_compiling")
        assert asked == ["is_compiling"] and not meta_sizes._dynamo_stand_in_fits
        assert "torch._dynamo" not in sys.modules
        a, b = ("a", TensorMeta((64, 512, 64), "float32")), ("b", TensorMeta((64, 512, 64), "float32"))
        node = Node("add", "aten.add.Tensor", [{"ref": "a"}, {"ref": "b"}], {}, [TensorMeta((64, 512, 64), "float32")])
        assert meta_sizes.check_graph_sizes(Graph([a, b], [node], ["add"])) == 8 << 20
        assert type(sys.modules["torch._dynamo"]).__name__ == "module"
        print("ok")
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
