"""Causal masks (kernorch.masks): found from the graph's constants alone, marked on their add, and a
causal attention kernel that skips the keys past each row tile and still computes the reference."""
import numpy as np
import pytest

from kernorch import dynamic, examples, fission, masks, measure
from kernorch.frontend import onnx as frontend
from kernorch.ir import structural_key

LAYERS = 2


def _decoder(seq):
    return examples.gpt_like(seq=seq, vocab=64, dim=32, heads=2, hidden=64, layers=LAYERS)


def _static(model):
    """The graph the pipeline fissions at a static shape (after the algebraic rewrites)."""
    from kernorch.rewrite import rewrite
    return fission.fission(rewrite(frontend.load(model)).graph)


def _marked(graph):
    return [p for p in graph.prims if p.attr(masks.CAUSAL_OPERAND) is not None]


def test_a_square_masked_above_its_diagonal_and_open_on_it_is_causal():
    n = 6
    causal = (1 - np.tril(np.ones((n, n), np.float32))) * -10000
    assert masks.is_causal(causal) and masks.is_causal(causal[None, None])
    assert masks.is_causal(np.where(np.tril(np.ones((n, n), bool)), 0, np.finfo(np.float32).min).astype(np.float32))
    assert not masks.is_causal(causal * 0.01)                        # -100 above the diagonal: not masked
    assert not masks.is_causal(causal - 10000 * np.eye(n, dtype=np.float32))  # each query masked from itself
    assert not masks.is_causal(causal.T)                             # masked below
    assert not masks.is_causal(causal[:, :-1])                       # not square
    assert not masks.is_causal(causal.astype(np.int32))
    got = masks.impose(np.random.default_rng(0).random((2, n, n), dtype=np.float32))
    assert masks.is_causal(got)


def test_the_decoders_causal_mask_is_marked_on_its_adds_statically_and_over_a_range():
    """gpt_like computes its mask from the length (Trilu of ones): fission folds it to a constant
    (over a range, the leading slice of its value at the range's end); the add of each layer's
    attention is marked with the mask's operand, which changes the kernels' keys. An encoder's key
    mask (an input) and a block without a mask are not marked."""
    static = masks.annotate(_static(_decoder(21)))
    generic = masks.annotate(dynamic.generic_graph(_decoder("seq"), dynamic.parse_range("seq=1..64")))
    for g in (static, generic):
        marked = _marked(g)
        assert len(marked) == LAYERS and all(p.op == "add" for p in marked)
        for p in marked:
            assert g.type_of(p.inputs[p.attr(masks.CAUSAL_OPERAND)]).shape[-2:] == p.type.shape[-2:]
    bound = dynamic.bind(generic, {"seq": 21})
    assert [p.name for p in _marked(bound)] == [p.name for p in _marked(static)]
    plain = _static(_decoder(21))
    p = _marked(static)[0]
    assert structural_key([p], static, [p.name]) != structural_key([plain.by_name[p.name]], plain, [p.name])
    assert masks.annotate(plain) is not plain and masks.annotate(static) is static
    bert = dynamic.generic_graph(examples.bert_like(seq="seq", vocab=64, dim=32, heads=2, hidden=64, layers=1),
                                 dynamic.parse_range("seq=1..64"))
    block = _static(examples.transformer_block(seq=16))
    assert masks.annotate(bert) is bert and masks.annotate(block) is block


def _attention(graph):
    """The first attention's kernel: from the scores to the values (and the softmax's normalization
    after them, kernorch.rewrite.after_attention), the transposes, reshapes and slices left out."""
    from kernorch.candidates import kernel_io
    from kernorch.ir import kernel_graph
    names = [q.name for q in graph.prims]
    mm = [q.name for q in graph.prims if q.op == "matmul" and q.inputs[1] not in graph.constants]
    end = names.index(mm[1]) + 1
    if graph.prims[end].op == "mul" and mm[1] in graph.prims[end].inputs:
        end += 1
    members = [n for n in names[names.index(mm[0]):end] if graph.by_name[n].op not in ("transpose", "reshape", "slice")]
    ins, outs = kernel_io(graph, members)
    return kernel_graph(graph, members, ins, outs), ins, outs


@pytest.mark.parametrize("tile", ["t4x16r", "t8x32r"])
@pytest.mark.parametrize("over", ["static", "range"])
def test_a_causal_attention_skips_the_keys_past_each_row_tile_and_is_right(tile, over):
    """The attention of a marked add runs its loops over the keys only up to each row tile's last
    row (`_skip_masked_keys`, loops annotated KEYS_OF), statically (seq=37: padded keys; 64: not)
    and over seq=1..128 at lengths on both sides of its tiles, and computes the reference with a
    causal mask (as `measure.make_inputs` draws it). With a mask that is not causal the keys it
    skipped would have counted: the result differs, so the skip is real."""
    from kernorch.backends import tvm as tb
    from kernorch.backends.tvm.lower import CAUSAL_ATTR, lower
    from kernorch.backends.tvm.schedule import KEYS_OF, schedule
    from kernorch.backends.tvm.target import make_target
    target = make_target(2)
    generic = masks.annotate(dynamic.generic_graph(_decoder("seq"), dynamic.parse_range("seq=1..128")))
    cases = [(masks.annotate(dynamic.bind(generic, {"seq": n})), None, [n]) for n in (37, 64)] if over == "static" \
        else [(generic, {"seq": 128}, [1, 4, 5, 17, 64, 100, 128])]
    for graph, bounds, lengths in cases:
        kg, ins, outs = _attention(graph)
        lowered = lower(kg, kg.prims, ins, outs, tile)
        assert lowered["main"].attrs[CAUSAL_ATTR]
        mod = schedule(lowered, target, tile, bounds)
        assert f'"{KEYS_OF}"' in mod["main"].script()
        kernel = tb.build(mod, target)
        for n in lengths:
            b = dynamic.bind(kg, {"seq": n}) if bounds else kg
            job = measure.KernelJob("k", "tvm", tile, b, tuple(ins), tuple(outs))
            inputs = measure.make_inputs(job)
            (mask,) = [x for t, x in zip(ins, inputs) if t in masks.causal_inputs(b)]
            assert masks.is_causal(mask) or n == 1
            shapes = [b.type_of(o).shape for o in outs]
            assert measure.check(job, kernel(*measure.kernel_args(job, inputs), out_shapes=shapes),
                                 measure.reference(job, inputs)) < 1e-4, n
            if n >= 17:  # a mask open everywhere: the keys past each tile count, and were skipped
                open_ = [np.zeros_like(x) if t in masks.causal_inputs(b) else x for t, x in zip(ins, inputs)]
                got = kernel(*measure.kernel_args(job, open_), out_shapes=shapes)[0]
                assert not np.allclose(got, measure.reference(job, open_)[0], atol=1e-3), n


def test_an_attention_reading_its_scores_out_does_not_skip():
    """A kernel whose outputs hold a tensor along the keys (here the masked scores themselves)
    would leave the skipped keys unwritten: not a causal attention."""
    from kernorch.backends.tvm.lower import causal_attention
    graph = masks.annotate(_static(_decoder(21)))
    kg, ins, outs = _attention(graph)
    assert causal_attention(kg, kg.prims, outs)
    marked = _marked(kg)[0].name
    assert not causal_attention(kg, kg.prims, [*outs, marked])


@pytest.mark.parametrize("over", ["static", "range"])
def test_a_mask_computed_from_constants_at_run_time_is_found_through_its_elementwise_prims(over):
    """A mask that is not folded (`(1 - tri) * -10000` computed by prims from a constant, over a
    range from a leading slice of one) is known through them; the same computed from an input is
    not, nor is a constant masked below its diagonal, nor one added to scores of a single row."""
    from kernorch.dynamic import SymDim
    from kernorch.ir import Graph, TensorType, make_prim
    n = SymDim("seq", (0, 1, 0)) if over == "range" else 8
    big = 16
    t, sq = TensorType((1, 2, n, n)), TensorType((n, n))
    tri = np.tril(np.ones((big, big) if over == "range" else (n, n), np.float32))
    consts = {"one": np.float32(1.0), "big": np.float32(-10000.0)}
    if over == "range":
        consts["tri.whole"] = tri
        head = (make_prim("tri", "slice", ["tri.whole"], sq, axes=(0, 1), begins=(0, 0), ends=(n, n), steps=(1, 1)),)
    else:
        consts["tri"] = tri
        head = ()

    def graph(source, consts=consts, head=head):
        prims = (*head, make_prim("open", "sub", ["one", source], sq), make_prim("mask", "mul", ["open", "big"], sq),
                 make_prim("y", "add", ["x", "mask"], t))
        ins = (("x", t),) + ((("m", sq),) if source == "m" else ())
        return Graph(ins, ("y",), prims, consts)
    marked = masks.annotate(graph("tri"))
    assert marked.by_name["y"].attr(masks.CAUSAL_OPERAND) == 1
    assert masks.causal_inputs(marked) == set()      # (the mask is computed inside, not an input)
    assert masks.annotate(graph("m")).by_name["y"].attr(masks.CAUSAL_OPERAND) is None
    flipped = {**consts, ("tri.whole" if over == "range" else "tri"): tri.T.copy()}
    assert masks.annotate(graph("tri", flipped)).by_name["y"].attr(masks.CAUSAL_OPERAND) is None
    # the other operand broadcast along the rows (one row of scores for every query): not marked
    row = Graph((("x", TensorType((1, 2, 1, n))),), ("y",),
                (*head, make_prim("open", "sub", ["one", "tri"], sq), make_prim("mask", "mul", ["open", "big"], sq),
                 make_prim("y", "add", ["x", "mask"], t)), consts)
    assert masks.annotate(row).by_name["y"].attr(masks.CAUSAL_OPERAND) is None


def test_inspect_names_the_causal_masks(tmp_path, capsys):
    """`kernorch inspect` lists the adds of a causal mask (JSON and text); a model without one, none."""
    import json
    import onnx
    from kernorch import cli
    path = tmp_path / "gpt.onnx"
    onnx.save(_decoder(16), str(path))
    assert cli.main(["inspect", str(path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["causal_masks"]
    assert len(found) == LAYERS and found == masks.marked(masks.annotate(_static(_decoder(16))))
    assert cli.main(["inspect", str(path)]) == 0
    squeezed = "".join(capsys.readouterr().out.split())  # (the console may wrap the line anywhere)
    assert "".join(f"causal masks added at {', '.join(found)}".split()) in squeezed
    onnx.save(examples.transformer_block(seq=16), str(path))
    assert cli.main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["causal_masks"] == []
