"""Small example models written with onnx.helper (no torch), deterministic random weights, opset 17.

They mirror the benchmark workloads at a size where a test runs in a second: `candy_like` is a fast
style-transfer network (reflect-padded convs, instance norm, residual blocks, nearest upsampling),
`transformer_block` a pre-norm encoder block (LayerNormalization, scaled multi-head attention, an
Erf-GELU MLP) written the way torch exports it; `bert_like` and `gpt_like` are BERT- and
GPT-2-architecture models with a symbolic sequence axis (token ids, masks, embeddings).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

OPSET = 17


class _Net:
    """A tiny graph writer: unique names, seeded weights, nodes in order."""

    def __init__(self, name: str, seed: int):
        from onnx import helper, numpy_helper
        self.h, self.nh = helper, numpy_helper
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.k = [], [], 0

    def fresh(self, tag: str) -> str:
        self.k += 1
        return f"{tag}_{self.k}"

    def init(self, arr: np.ndarray, tag: str) -> str:
        name = self.fresh(tag)
        self.inits.append(self.nh.from_array(np.asarray(arr), name))
        return name

    def weight(self, shape, fan_in: int, tag: str = "w") -> str:
        return self.init((self.rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32), tag)

    def vec(self, n: int, mean: float = 0.0, std: float = 0.1, tag: str = "b") -> str:
        return self.init((mean + std * self.rng.standard_normal(n)).astype(np.float32), tag)

    def const(self, values, dtype=np.int64, tag: str = "c") -> str:
        return self.init(np.array(values, dtype), tag)

    def linear(self, x: str, cin: int, cout: int) -> str:
        return self.node("Add", [self.node("MatMul", [x, self.weight((cin, cout), cin)]), self.vec(cout)])

    def layer_norm(self, x: str, dim: int, eps: float = 1e-5) -> str:
        return self.node("LayerNormalization", [x, self.vec(dim, 1.0), self.vec(dim)], axis=-1, epsilon=eps)

    def attention(self, x: str, dim: int, heads: int, length: int, bias: str | None = None, batch: int = 1) -> str:
        """Multi-head self-attention as torch exports it (q, k, v projections reshaped to heads,
        scores scaled, `bias` added before the softmax when given, the output projection);
        `length` -1 for a symbolic sequence axis, `batch` 0 for a symbolic batch (the input's)."""
        hd = dim // heads
        q, k, v = (self.node("Reshape", [self.linear(x, dim, dim), self.const([batch, length, heads, hd])])
                   for _ in range(3))
        q = self.node("Transpose", [q], perm=[0, 2, 1, 3])
        k = self.node("Transpose", [k], perm=[0, 2, 3, 1])
        v = self.node("Transpose", [v], perm=[0, 2, 1, 3])
        s = self.node("Div", [self.node("MatMul", [q, k]), self.const(math.sqrt(hd), np.float32)])
        if bias is not None:
            s = self.node("Add", [s, bias])
        a = self.node("Transpose", [self.node("MatMul", [self.node("Softmax", [s], axis=-1), v])], perm=[0, 2, 1, 3])
        return self.linear(self.node("Reshape", [a, self.const([batch, length, dim])]), dim, dim)

    def gelu_mlp(self, x: str, dim: int, hidden: int) -> str:
        """dim -> hidden, GELU in the Erf pattern torch exports, hidden -> dim."""
        f = self.linear(x, dim, hidden)
        erf = self.node("Erf", [self.node("Div", [f, self.const(math.sqrt(2.0), np.float32)])])
        g = self.node("Mul", [self.node("Mul", [f, self.node("Add", [erf, self.const(1.0, np.float32)])]),
                              self.const(0.5, np.float32)])
        return self.linear(g, hidden, dim)

    def node(self, op: str, inputs, n_out: int = 1, **attrs):
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(self.h.make_node(op, list(inputs), outs, name=self.fresh(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def model(self, inputs, outputs):
        """`inputs` are (name, shape) or (name, shape, onnx element type); `outputs` are (tensor,
        public name, shape): the tensor is renamed so the model reads well."""
        from onnx import TensorProto
        h = self.h
        for tensor, public, _ in outputs:
            for nd in self.nodes:
                for i, o in enumerate(nd.output):
                    if o == tensor:
                        nd.output[i] = public
                for i, o in enumerate(nd.input):
                    if o == tensor:
                        nd.input[i] = public
        outputs = [(public, shape) for _, public, shape in outputs]
        g = h.make_graph(self.nodes, self.name,
                         [h.make_tensor_value_info(i[0], i[2] if len(i) > 2 else TensorProto.FLOAT, i[1])
                          for i in inputs],
                         [h.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs], self.inits)
        m = h.make_model(g, opset_imports=[h.make_opsetid("", OPSET)], producer_name="kernorch.examples")
        m.ir_version = 8
        return m


def candy_like(size: int = 64, width: int = 16, blocks: int = 2, seed: int = 0):
    """Johnson-style style transfer: conv/IN/relu down, residual blocks, nearest-upsample up."""
    n = _Net("candy_like", seed)

    def conv(x, cin, cout, k, stride=1, norm=True, relu=True):
        p = k // 2
        x = n.node("Pad", [x, n.init(np.array([0, 0, p, p, 0, 0, p, p], np.int64), "pads")], mode="reflect")
        x = n.node("Conv", [x, n.weight((cout, cin, k, k), cin * k * k), n.vec(cout)],
                   kernel_shape=[k, k], strides=[stride, stride])
        if norm:
            x = n.node("InstanceNormalization", [x, n.vec(cout, 1.0), n.vec(cout)], epsilon=1e-5)
        return n.node("Relu", [x]) if relu else x

    x = conv("input", 3, width, 9)
    x = conv(x, width, 2 * width, 3, stride=2)
    x = conv(x, 2 * width, 4 * width, 3, stride=2)
    c = 4 * width
    for _ in range(blocks):
        y = conv(x, c, c, 3)
        y = conv(y, c, c, 3, relu=False)
        x = n.node("Add", [x, y])
    for cout in (2 * width, width):
        x = n.node("Resize", [x, "", n.init(np.array([1, 1, 2, 2], np.float32), "scales")], mode="nearest",
                   coordinate_transformation_mode="asymmetric", nearest_mode="floor")
        x = conv(x, c, cout, 3)
        c = cout
    x = conv(x, c, 3, 9, norm=False, relu=False)
    return n.model([("input", [1, 3, size, size])], [(x, "output", [1, 3, size, size])])


def transformer_block(seq: int | str = 32, dim: int = 64, heads: int = 4, hidden: int = 256, seed: int = 1,
                      batch: int | str = 1):
    """Pre-norm encoder block: x + Attn(LN(x)), then + MLP(LN(.)) with the Erf-GELU export pattern.
    `seq` a name (e.g. "seq"): the sequence axis is symbolic (an ONNX dim_param; reshapes infer it);
    `batch` a name: the batch axis is (reshapes copy it from their input)."""
    n = _Net("transformer_block", seed)
    length = -1 if isinstance(seq, str) else seq
    x = n.node("Add", ["x", n.attention(n.layer_norm("x", dim), dim, heads, length,
                                        batch=0 if isinstance(batch, str) else batch)])
    x = n.node("Add", [x, n.gelu_mlp(n.layer_norm(x, dim), dim, hidden)])
    return n.model([("x", [batch, seq, dim])], [(x, "y", [batch, seq, dim])])


def bert_like(seq: int | str = "seq", vocab: int = 512, dim: int = 64, heads: int = 4, hidden: int = 256,
              layers: int = 2, max_positions: int = 512, seed: int = 2):
    """A BERT-architecture encoder written the way torch exports it, with a symbolic sequence axis by
    default: token ids, position ids (int64) and an attention mask in, word and position embeddings
    gathered by id, post-norm layers whose attention adds the extended mask (1 - mask) * -10000, the
    hidden states and a tanh pooler over the first token out. The position ids are an input (as
    transformers' BERT accepts): computed inside from the length (a slice of a buffer), they fold to
    a constant that changes with the length, which kernorch.dynamic refuses. Weights are random
    (deterministic): the architecture, not BERT's."""
    from onnx import TensorProto
    n = _Net("bert_like", seed)
    length = -1 if isinstance(seq, str) else seq
    words = n.node("Gather", [n.weight((vocab, dim), 1, "word_embeddings"), "input_ids"], axis=0)
    positions = n.node("Gather", [n.weight((max_positions, dim), 1, "position_embeddings"), "position_ids"], axis=0)
    x = n.layer_norm(n.node("Add", [words, positions]), dim, 1e-12)
    mask = n.node("Mul", [n.node("Sub", [n.const(1.0, np.float32), "attention_mask"]), n.const(-10000.0, np.float32)])
    mask = n.node("Unsqueeze", [mask, n.const([1, 2])])          # (1, 1, 1, seq)
    for _ in range(layers):
        x = n.layer_norm(n.node("Add", [x, n.attention(x, dim, heads, length, mask)]), dim, 1e-12)
        x = n.layer_norm(n.node("Add", [x, n.gelu_mlp(x, dim, hidden)]), dim, 1e-12)
    first = n.node("Gather", [x, n.const(0)], axis=1)            # (1, dim): the first token
    pooled = n.node("Tanh", [n.linear(first, dim, dim)])
    return n.model([("input_ids", [1, seq], TensorProto.INT64), ("position_ids", [1, seq], TensorProto.INT64),
                    ("attention_mask", [1, seq])],
                   [(x, "last_hidden_state", [1, seq, dim]), (pooled, "pooler_output", [1, dim])])


def gpt_like(seq: int | str = "seq", vocab: int = 512, dim: int = 64, heads: int = 4, hidden: int = 256,
             layers: int = 1, max_positions: int = 1024, seed: int = 3, batch: int | str = 1):
    """A GPT-2-architecture decoder written the way torch exports it, with a symbolic sequence axis:
    token ids in; the positions (`Range` over the length taken from `Shape`) and the causal mask
    (`Trilu` of ones of shape length x length) computed inside the model, so they fold to constants
    that change with the length (kernorch.dynamic makes them slices of their values at the range's
    end); pre-norm layers, tied output embedding, logits out. Random weights (deterministic).
    `batch` a name: the batch axis is symbolic too (the attention's reshapes copy it)."""
    from onnx import TensorProto
    n = _Net("gpt_like", seed)
    length = -1 if isinstance(seq, str) else seq
    wte = n.weight((vocab, dim), 1, "wte")
    count = n.node("Gather", [n.node("Shape", ["input_ids"]), n.const(1)], axis=0)      # the length, a scalar
    positions = n.node("Range", [n.const(0), count, n.const(1)])
    x = n.node("Add", [n.node("Gather", [wte, "input_ids"], axis=0),
                       n.node("Gather", [n.weight((max_positions, dim), 1, "wpe"), positions], axis=0)])
    square = n.node("Concat", [n.node("Unsqueeze", [count, n.const([0])])] * 2, axis=0)
    lower = n.node("Trilu", [n.node("ConstantOfShape", [square], value=n.nh.from_array(np.array([1.0], np.float32)))],
                   upper=0)
    bias = n.node("Mul", [n.node("Sub", [n.const(1.0, np.float32), lower]), n.const(-10000.0, np.float32)])
    for _ in range(layers):
        x = n.node("Add", [x, n.attention(n.layer_norm(x, dim), dim, heads, length, bias,
                                          batch=0 if isinstance(batch, str) else batch)])
        x = n.node("Add", [x, n.gelu_mlp(n.layer_norm(x, dim), dim, hidden)])
    logits = n.node("MatMul", [n.layer_norm(x, dim), n.node("Transpose", [wte], perm=[1, 0])])
    return n.model([("input_ids", [batch, seq], TensorProto.INT64)], [(logits, "logits", [batch, seq, vocab])])


EXAMPLES: dict[str, Callable] = {"candy_like": candy_like, "transformer_block": transformer_block}


def save_examples(directory) -> list[Path]:
    """Write every example as DIR/NAME.onnx; returns the paths."""
    import onnx
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in EXAMPLES.items():
        p = d / f"{name}.onnx"
        onnx.save(build(), str(p))
        log.info("wrote %s", p)
        paths.append(p)
    return paths
