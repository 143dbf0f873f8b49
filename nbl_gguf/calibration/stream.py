"""Layer-streamed calibration: one decoder layer's weights in memory at a time.

The model is a module tree on the meta device (calibration.weights). The calibration windows' hidden
states go from layer to layer (calibration.hidden); for each layer k: its weights are read, the
windows run through it while hooks fold its attention input X and output Y into the statistics, its
map is solved and saved, and its weights are freed. The held-out windows ride along unchanged, and
their input of every layer is kept on disk, so that layer selection can start a variant of the model
at the first layer it replaces (StreamedEvaluator). Peak memory is one layer, one layer's statistics
and the hidden states, whatever the number of layers. This module is the layer runtime; the loop
is calibration.layer_loop, where the hidden states go calibration.memory_plan, and the variants of
the model that layer selection measures calibration.variants.

The decoder layers are called with the arguments the model's own forward gives them (masks, rotary
embeddings, sliding windows, per-layer types): they are recorded once per batch shape by running the
model's forward with every layer swapped for a recorder. The embedding is needed only for the rows of
the tokens in the text, the LM head only for the held-out losses.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from nbl_gguf import models
from nbl_gguf.calibration import weights as weight_io
from nbl_gguf.calibration.hidden import tensor_bytes
from nbl_gguf.errors import NblError

LOSS_POSITIONS = 256  # positions per LM-head matmul: the logits of a whole window may not fit


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during a forward of the model: records the arguments the
    model gives the layer, and passes the hidden states on (or puts ``inject`` in their place)."""

    def __init__(self, index: int, calls: dict, inputs: dict, tuple_output: bool, inject=None):
        super().__init__()
        self.index, self.calls, self.inputs, self.tuple_output, self.inject = index, calls, inputs, tuple_output, inject

    def forward(self, hidden_states, *args, **kwargs):
        self.calls[self.index] = (args, kwargs)
        self.inputs[self.index] = hidden_states
        out = hidden_states if self.inject is None else self.inject
        return (out,) if self.tuple_output else out


class _Stop(Exception):
    pass


def _tuple_output() -> bool:
    return int(__import__("transformers").__version__.split(".")[0]) < 5


def layer_inputs(model, index: int, ids: torch.Tensor) -> torch.Tensor:
    """The input of decoder layer ``index`` of a model in memory for token windows ``ids`` [n, seqlen], one
    window at a time, without running the layers from ``index`` on."""
    layer = models.decoder_layers(model)[index]
    seen = []

    def record(_module, positional: tuple, named: dict):
        seen.append((positional[0] if positional else named["hidden_states"]).detach().clone())
        raise _Stop

    handle = layer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(ids.shape[0]):
                try:
                    model(input_ids=ids[i:i + 1], use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return torch.cat(seen)


@contextmanager
def starting_at(model, index: int, hidden: torch.Tensor):
    """The model's own forward (masks, rotary embeddings, final norm, head) from decoder layer ``index`` on,
    with ``hidden`` (layer_inputs') as that layer's input: the layers before it are not run. What a model
    whose changes all lie at or after ``index`` computes, at the cost of its later layers alone."""
    layers = models.decoder_layers(model)
    saved = [layers[i] for i in range(index)]
    tuple_output = _tuple_output()
    for i in range(index):  # what they record is not read
        layers[i] = _Recorder(i, {}, {}, tuple_output, hidden if i == index - 1 else None)
    try:
        yield
    finally:
        for i, layer in enumerate(saved):
            layers[i] = layer


# (config, tokenizer) of each source already read in this process. A GGUF's tokenizer is rebuilt from its
# vocabulary by transformers, tens of seconds for a 150K vocabulary, and one convert opens the model up to
# four times (calibration, best at m, window layers, refinement).
_LOADED: dict[tuple, tuple] = {}


def _source_key(source) -> tuple:
    if source.gguf is not None:
        return ("gguf", source.gguf.sha256)
    folder = source.hf_folder()
    return ("folder", str(folder.resolve()),
            tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(folder.iterdir()) if p.is_file()))


def load_config_and_tokenizer(source):
    """(config, tokenizer) of a model_source.ModelSource without reading its weights: read once per
    process, each caller given its own copy of the config (the tokenizer is shared: nothing here
    changes one)."""
    import copy

    key = _source_key(source)
    if key not in _LOADED:
        _LOADED[key] = _read_config_and_tokenizer(source)
    config, tokenizer = _LOADED[key]
    return copy.deepcopy(config), tokenizer


def _read_config_and_tokenizer(source):
    from transformers import AutoConfig, AutoTokenizer

    from nbl_gguf.gguf_header import read_header
    from nbl_gguf.gguf_rope import rope_scaling, with_rope_scaling

    if source.gguf is not None:
        folder, name = str(source.gguf.path.parent), source.gguf.path.name
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = str(source.hf_folder()), {}
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
        if source.gguf is not None:  # the rope scaling the file asks of llama.cpp, which transformers does not read
            config = with_rope_scaling(config, rope_scaling(read_header(source.gguf.path)))
        models.get_adapter(config)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except NblError:
        raise
    except Exception as error:  # noqa: BLE001 - each loader has its own error types
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise NblError(f"cannot load the model's config or tokenizer from {source.gguf.path if source.gguf else folder} "
                       f"({type(error).__name__}: {first})") from error
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config, tokenizer


class LayerStream:
    """A model run one decoder layer at a time from a WeightSource: a model_source.ModelSource's file
    or folder (``LayerStream(source, dtype, device)``), or a model in memory (``LayerStream.resident``)."""

    def __init__(self, source, dtype, device: str, name: str | None = None):
        config, tokenizer = load_config_and_tokenizer(source)
        path = str(source.gguf.path if source.gguf is not None else source.hf_folder())
        self._build(config, tokenizer, dtype, device, name or source.name, path,
                    lambda skeleton: weight_io.open_source(skeleton, source))

    @classmethod
    def resident(cls, model, tokenizer=None, name: str = "the loaded model") -> "LayerStream":
        """The stream over a model already in memory, in its dtype and on its device (its weights are
        served, not copied)."""
        import copy

        stream = cls.__new__(cls)
        weight = next(model.parameters())
        stream._build(copy.deepcopy(model.config), tokenizer, weight.dtype, str(weight.device), name,
                      getattr(model.config, "_name_or_path", ""),
                      lambda skeleton: weight_io.ResidentSource(skeleton, model))
        return stream

    def _build(self, config, tokenizer, dtype, device: str, name: str, path: str, open_weights) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.adapter = models.get_adapter(self.config)
        self.dtype, self.device = dtype, device
        self.name, self.path = name, path
        self.model = weight_io.skeleton(self.config, dtype)
        self.weights = open_weights(self.model)
        self.base = models.base_model(self.model)
        self.layers = models.decoder_layers(self.model)
        self.embed_name = weight_io.module_name(self.model, self.model.get_input_embeddings()) + ".weight"
        head = self.model.get_output_embeddings()
        self.head_name = weight_io.module_name(self.model, head) + ".weight"
        self.tuple_output = _tuple_output()
        text = models.text_config(self.config)
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.hidden_size = text.hidden_size
        # the decoder's small parameters (final norm, ...): everything under the decoder stack that is
        # neither a layer nor the embedding; a vision tower beside it is never read
        base_prefix = self.adapter.base + "."
        layer_prefix = self.adapter.layers + "."
        for param_name, _ in list(self.model.named_parameters()):
            if param_name.startswith(base_prefix) and not param_name.startswith(layer_prefix) \
                    and param_name != self.embed_name:
                self.weights.load_parameter(param_name, dtype, device)
        self._calls: dict[int, list] = {}  # batch size -> [(args, kwargs)] per layer
        self._embedding_rows: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_prefix(self, index: int) -> str:
        return f"{self.adapter.layers}.{index}"

    def layer_bytes(self) -> int:
        """Bytes of one decoder layer's parameters in the compute dtype (the largest layer)."""
        sizes = [sum(tensor_bytes(p.shape, self.dtype) for p in layer.parameters()) for layer in self.layers]
        return max(sizes)

    # --- running the model's own forward around the layers ------------------------------------------

    @contextmanager
    def _recorders(self, calls: dict, inputs: dict, inject=None):
        saved = list(self.layers)
        last = len(saved) - 1
        for i in range(len(saved)):
            self.layers[i] = _Recorder(i, calls, inputs, self.tuple_output, inject if i == last else None)
        try:
            yield
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer

    def _forward_base(self, inputs_embeds: torch.Tensor, inject=None):
        calls, inputs = {}, {}
        with torch.no_grad(), self._recorders(calls, inputs, inject):
            out = self.base(inputs_embeds=inputs_embeds, use_cache=False)
        return calls, inputs, out

    def calls(self, batch: int, seqlen: int) -> list:
        """The (args, kwargs) the model's forward passes to each layer for a batch of this shape."""
        key = (batch, seqlen)
        if key not in self._calls:
            zeros = torch.zeros(batch, seqlen, self.hidden_size, dtype=self.dtype, device=self.device)
            calls, _, _ = self._forward_base(zeros)
            self._calls[key] = [calls[i] for i in range(self.num_layers)]
        return self._calls[key]

    def prepare_embedding(self, *token_sets: torch.Tensor) -> None:
        """Read the embedding rows of every token in ``token_sets`` (and no others)."""
        rows = torch.unique(torch.cat([t.reshape(-1) for t in token_sets if t is not None]))
        table = self.weights.embedding_rows(self.embed_name, rows, self.dtype).to(self.device)
        weight_io.set_parameter(self.model, self.embed_name, table)
        self._embedding_rows = rows.to(self.device)

    def release_embedding(self) -> None:
        param = self.model.get_parameter(self.embed_name)
        weight_io.set_parameter(self.model, self.embed_name,
                                torch.empty((0, param.shape[1]), dtype=self.dtype, device="meta"))
        self._embedding_rows = None

    def embed_all(self, ids: torch.Tensor, batch_size: int = 1) -> torch.Tensor:
        """embed() of windows ``ids`` [n, seqlen], ``batch_size`` at a time, with only their embedding rows
        read (prepare_embedding) and released after."""
        self.prepare_embedding(ids)
        try:
            return torch.cat([self.embed(ids[start:stop]) for start, stop in batches(ids.shape[0], batch_size)])
        finally:
            self.release_embedding()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The input of layer 0 for token windows ``ids`` [batch, seqlen] (embedding, and any scaling
        the model's forward applies before its first layer)."""
        ids = ids.to(self.device)
        local = torch.searchsorted(self._embedding_rows, ids)
        if not torch.equal(self._embedding_rows[local.clamp(max=len(self._embedding_rows) - 1)], ids):
            raise NblError("embed(): a token outside the prepared embedding rows")
        embedding = self.model.get_input_embeddings()
        # the module's padding index names a row of the whole vocabulary, which the prepared rows may not
        # hold; it only shapes gradients, so the lookup (and any scaling the module applies) is the same
        padding_idx, embedding.padding_idx = embedding.padding_idx, None
        try:
            with torch.no_grad():
                inputs_embeds = embedding(local)
        finally:
            embedding.padding_idx = padding_idx
        calls, inputs, _ = self._forward_base(inputs_embeds)
        self._calls.setdefault(tuple(ids.shape), [calls[i] for i in range(self.num_layers)])
        return inputs[0]

    # --- layers -----------------------------------------------------------------------------------------

    def load_layer(self, index: int) -> None:
        self.weights.load(self.layer_prefix(index), self.dtype, self.device)

    def release_layer(self, index: int) -> None:
        weight_io.release_parameters(self.model, self.layer_prefix(index))

    def run_layer(self, index: int, hidden: torch.Tensor, grad: bool = False) -> torch.Tensor:
        """Layer ``index``'s output for ``hidden``; ``grad``: with autograd (calibration.refine's streamed form
        trains a replaced layer's map)."""
        args, kwargs = self.calls(hidden.shape[0], hidden.shape[1])[index]
        with torch.set_grad_enabled(grad):
            return _first(self.layers[index](hidden.to(self.device), *args, **kwargs))

    # --- the LM head ------------------------------------------------------------------------------------

    def load_head(self) -> None:
        weight_io.set_parameter(self.model, self.head_name,
                                self.weights.matrix(self.head_name, self.dtype).to(self.device))

    def release_head(self) -> None:
        param = self.model.get_parameter(self.head_name)
        weight_io.set_parameter(self.model, self.head_name,
                                torch.empty(param.shape, dtype=self.dtype, device="meta"))

    def token_nll(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Next-token NLL [windows, seqlen - 1] (float64, CPU) of windows ``ids`` whose last layer's output
        is ``hidden``: the model's final norm, its head and logit soft-capping, as its forward computes them."""
        normed = self._final_norm(hidden)
        ids = ids.to(self.device)
        seqlen = ids.shape[1]
        values = torch.empty(ids.shape[0], seqlen - 1, dtype=torch.float64)
        # one window's LOSS_POSITIONS rows at a time: the logits of every window at once were 2.6 GB at a
        # 128K vocabulary for 8 windows; a window's rows are contiguous, which keeps torch's bf16 CPU matmul
        # on its fast path (a slice across windows keeps their batch stride: 10x slower at the 8B shape)
        for window in range(ids.shape[0]):
            for start in range(0, seqlen - 1, LOSS_POSITIONS):
                stop = min(seqlen - 1, start + LOSS_POSITIONS)
                nll = self._head_nll(normed[window, start:stop], ids[window, start + 1:stop + 1])
                values[window, start:stop] = nll.double().cpu()
        return values

    def scored_nll(self, hidden: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        """token_nll's values at the positions ``scored`` [windows, seqlen - 1] (bool) only, in row-major order
        (float64, CPU): the head runs on those rows alone. A retrieval probe scores a few answer tokens of
        thousands: the full head on every position (Qwen2.5's vocabulary: 1.1 TFLOP a 4,096-token window) was
        most of each probe's cost."""
        scored = scored.to(self.device)
        normed = self._final_norm(hidden)
        return self._head_nll(normed[:, :-1][scored], ids.to(self.device)[:, 1:][scored]).double().cpu()

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm of a last layer's output ``hidden``, as its forward applies it."""
        hidden = hidden.to(self.device)
        _, _, out = self._forward_base(torch.zeros_like(hidden), inject=hidden)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _head_nll(self, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The NLL of ``targets`` [rows] under the head (and soft-capping) of normed hidden ``rows`` [rows, d]."""
        with torch.no_grad():
            logits = self.model.get_output_embeddings()(rows)
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


def batches(count: int, batch_size: int):
    for start in range(0, count, max(1, batch_size)):
        yield start, min(count, start + max(1, batch_size))
