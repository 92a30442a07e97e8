"""`pyspice models derive NAME`: the slow, reproducible half of a built-in model.

Runs the dense model on the calibration part of its corpus (`pydoc_data.topics`
for smolmoe, the pinned mix of corpus_mix for smolmoe-b) and
MoEfies it layer by layer on the MoE's OWN hidden states: layer l is fitted on
the inputs that layers 0..l-1, already MoEfied, produce, so each router and
scale sees what it will see at inference. Its target is halfway between the
dense FFN's answer on those inputs and what would put the residual stream
back on the dense model's (`dense_pull`): each layer also undoes part of the
drift the earlier ones left. Writes the recipe (`models/NAME/`) and the
sha256 of the GGUF each quant builds to; the build then needs only the wheel
and these arrays.

torch is needed here only (the `calibrate` extra); runs on CPU, seeded.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pyspice.models.corpus import Split, text_of, topic_texts
from pyspice.models.corpus_mix import MixSplit, mix_text, source_docs
from pyspice.models.smollm2 import dense_gguf, load_dense
from pyspice.models.smolmoe_build import record_gguf_hashes
from pyspice.models.smolmoe_recipe import (
    RECIPE_VERSION,
    MoeShape,
    Recipe,
    RecipeArrays,
    file_sha256,
)

CHUNK = 512  # tokens per calibration sequence, the context eval ppl uses


@dataclass(frozen=True)
class DeriveConfig:
    shape: MoeShape = field(default_factory=MoeShape)
    chunks: int = 48  # calibration sequences of CHUNK tokens
    eval_chunks: int = 8  # held-out sequences for the torch perplexity printed at the end
    seed: int = 0
    router_steps: int = 150  # Adam steps of router training per layer
    router_target: str = "gain"  # the "true top-k" the router learns: largest output norm, or "gain"
    dense_pull: float = 0.5  # 0: fit each FFN to the dense FFN on the MoE's inputs; 1: to the dense stream
    record_hashes: bool = True  # build each quant and record its sha256 in recipe.json
    threads: int = 1  # torch threads; one avoids spinning against other work on small machines


def log(message: str) -> None:
    print(f"derive: {message}", file=sys.stderr, flush=True)


# The model's own chat template (tokenizer.chat_template) with its default
# system prompt: calibration also covers the positions a chat puts the model in.
_CHAT_FRAME = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain {key} in Python.<|im_end|>\n<|im_start|>assistant\n{text}<|im_end|>\n"
)


def tokenize(dense_path: Path, text: str, *, special: bool = False) -> list[int]:
    """Token ids as llama.cpp makes them for this model (its own tokenizer, vocab only)."""
    # lazy: loads libllama
    import llama_cpp

    vocab = llama_cpp.Llama(str(dense_path), vocab_only=True, verbose=False)
    try:
        return list(vocab.tokenize(text.encode("utf-8"), add_bos=True, special=special))
    finally:
        vocab.close()


# what the user turn asks for, per source of the mixed corpus
_ASK = {
    "pydoc": "Explain {key} in Python.",
    "man": "Show the manual page {key}.",
    "code": "Show the source of the Python module {key}.",
}


def _frame(ask: str, text: str) -> str:
    head, _, tail = _CHAT_FRAME.partition("Explain {key} in Python.")
    return head + ask + tail.format(text=text)


def chat_stream(split: Split | MixSplit) -> str:
    """The calibration documents as chat turns: "Explain KEY in Python." (or what fits the
    document's source) answered by the document's text."""
    if isinstance(split, MixSplit):
        docs = source_docs(split, "calibration")
        return "".join(_frame(_ASK[src].format(key=key), text) for src, key, text in docs)
    return "".join(_CHAT_FRAME.format(key=key, text=text) for key, text in topic_texts(split, "calibration"))


@dataclass(frozen=True)
class _CorpusFacts:
    heldout: str
    calibration_sha256: str | dict[str, str]
    matches: bool


def _corpus_facts(split: Split | MixSplit) -> _CorpusFacts:
    if isinstance(split, MixSplit):  # checked against its pins: a mismatch has raised already
        sha = {name: s.sha256["calibration"] for name, s in split.sources.items()}
        return _CorpusFacts(mix_text(split, "heldout"), sha, True)
    calib = text_of(split, "calibration")
    if not calib.matches_split:
        log("this Python's calibration text differs from the committed split's; the recipe will differ")
    return _CorpusFacts(text_of(split, "heldout").text, split.sha256["calibration"], calib.matches_split)


def _chunks(ids: list[int], n: int, *, spread: bool = False) -> Any:
    """n chunks of CHUNK tokens: the first n, or (spread) n evenly spaced over the whole text."""
    # lazy: torch is optional, needed only to derive the recipe (here and in the modules below)
    import torch

    total = len(ids) // CHUNK
    usable = min(n, total)
    if usable < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one {CHUNK}-token chunk")
    picks = [i * total // usable for i in range(usable)] if spread else list(range(usable))
    return torch.tensor([ids[i * CHUNK : (i + 1) * CHUNK] for i in picks])


def derive(
    out_dir: Path,
    config: DeriveConfig,
    split: Split | MixSplit,
    *,
    name: str = "smolmoe",
    progress: bool = True,
) -> Recipe:
    # lazy: torch is optional, needed only to derive the recipe (here and in the modules below)
    import torch

    from pyspice.models import torch_blocks as tb
    from pyspice.models.moefy import apply_layer, fit_layer

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    started = time.perf_counter()
    dense_path = dense_gguf()
    model = load_dense(dense_path)
    cfg = model.config
    config.shape.check(cfg.n_ff)

    facts = _corpus_facts(split)
    # chat-framed and spread over every calibration topic, not just the first topics' text
    train = _chunks(tokenize(dense_path, chat_stream(split), special=True), config.chunks, spread=True)
    evals = _chunks(tokenize(dense_path, facts.heldout), config.eval_chunks)
    log(f"{train.numel()} calibration tokens, {evals.numel()} held-out tokens for the check")

    layers = [tb.TorchLayer.of(layer) for layer in model.layers]
    rope = tb.Rope(cfg, CHUNK)
    embd = torch.from_numpy(model.token_embd.copy())
    out_norm = torch.from_numpy(model.output_norm.copy())
    mb = 8  # sequences per attention batch: bounds the score matrix memory

    def attend(h: torch.Tensor, layer: tb.TorchLayer) -> torch.Tensor:
        return torch.cat([tb.attention(h[i : i + mb], layer, cfg, rope) for i in range(0, len(h), mb)])

    n_layer = cfg.n_layer
    arrays = RecipeArrays(
        order=np.zeros((n_layer, cfg.n_ff), np.int16),
        down_scale=np.zeros((n_layer, cfg.n_ff), np.float32),
        router=np.zeros((n_layer, config.shape.n_expert, cfg.n_embd), np.float32),
        shexp_gate=np.zeros((n_layer, cfg.n_embd), np.float32),
    )
    reports = []
    with torch.no_grad():
        h = embd[train]
        h_dense = h.clone() if config.dense_pull else h
        h_eval_d = embd[evals]
        h_eval_m = embd[evals]
        for il in tqdm(range(n_layer), desc=f"derive {name}", file=sys.stderr, disable=not progress):
            layer = layers[il]
            h = attend(h, layer)
            x = tb.ffn_input(h, layer, cfg).reshape(-1, cfg.n_embd)
            act = tb.neuron_activations(x, layer)
            y = act @ layer.down.T
            if config.dense_pull:
                # pull the MoE's residual stream towards the dense model's after this layer
                h_dense = attend(h_dense, layer)
                xd = tb.ffn_input(h_dense, layer, cfg)
                h_dense = h_dense + tb.neuron_activations(xd, layer) @ layer.down.T
                y = y + config.dense_pull * (h_dense - h).reshape_as(y) - config.dense_pull * y
            with torch.enable_grad():
                recipe, report, out = fit_layer(
                    x,
                    act,
                    y,
                    layer.down,
                    config.shape,
                    config.seed * 1000 + il,
                    config.router_steps,
                    config.router_target,
                )
            h = h + out.view_as(h)
            reports.append(report)
            arrays.order[il] = recipe.order.numpy().astype(np.int16)
            arrays.down_scale[il] = recipe.down_scale.numpy()
            arrays.router[il] = recipe.router.numpy()
            arrays.shexp_gate[il] = recipe.shexp_gate.numpy()
            # held-out check: the dense and the MoE streams side by side
            h_eval_d = attend(h_eval_d, layer)
            xd = tb.ffn_input(h_eval_d, layer, cfg)
            h_eval_d = h_eval_d + tb.neuron_activations(xd, layer) @ layer.down.T
            h_eval_m = attend(h_eval_m, layer)
            xm = tb.ffn_input(h_eval_m, layer, cfg).reshape(-1, cfg.n_embd)
            moe = apply_layer(xm, tb.neuron_activations(xm, layer), layer.down, recipe, config.shape)
            h_eval_m = h_eval_m + moe.view_as(h_eval_m)
            log(f"layer {il}: router recall {report.router_recall:.3f}, fit error {report.rel_error:.3f}")
        ppl_d, ppl_m, agree = _compare(h_eval_d, h_eval_m, evals, out_norm, embd, cfg.rms_eps)
    elapsed = time.perf_counter() - started
    log(
        f"torch check on held-out: dense ppl {ppl_d:.3f}, {name} ppl {ppl_m:.3f} ({ppl_m / ppl_d:.2f}x), "
        f"top-1 agreement {agree:.3f}; {elapsed:.0f} s"
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    npz = out_dir / "recipe.npz"
    arrays.save(npz)
    (out_dir / "split.json").write_text(split.to_json())
    recipe_obj = Recipe(
        version=RECIPE_VERSION,
        shape=config.shape,
        arrays_sha256=file_sha256(npz),
        derivation={
            "command": f"pyspice models derive {name}",
            "calibration_format": "chat turns (model's template), chunks spread over all documents",
            "config": {k: v for k, v in asdict(config).items() if k != "shape"},
            "calibration_tokens": int(train.numel()),
            "calibration_text_sha256": facts.calibration_sha256,
            "calibration_text_matches": facts.matches,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "seconds": round(elapsed),
            "router_recall": [round(r.router_recall, 4) for r in reports],
            "fit_rel_error": [round(r.rel_error, 4) for r in reports],
            "torch_check": {"dense_ppl": ppl_d, "smolmoe_ppl": ppl_m, "top1_agreement": agree},
        },
    )
    (out_dir / "recipe.json").write_text(recipe_obj.to_json())
    if config.record_hashes:
        recipe_obj.gguf_sha256 = record_gguf_hashes(out_dir, name=name, progress=progress)
        log(f"built GGUF sha256: {recipe_obj.gguf_sha256}")
    return recipe_obj


def _compare(
    h_d: Any, h_m: Any, tokens: Any, out_norm: Any, embd: Any, eps: float
) -> tuple[float, float, float]:
    """Perplexity of both streams on each chunk's second half (as eval ppl scores), top-1 agreement."""
    # lazy: torch is optional, needed only to derive the recipe (here and in the modules below)
    import torch

    from pyspice.models.torch_blocks import logits

    first = CHUNK // 2
    nll_d = nll_m = 0.0
    agree = count = 0
    for i in range(len(tokens)):
        ld = logits(h_d[i, first:-1], out_norm, embd, eps).double()
        lm = logits(h_m[i, first:-1], out_norm, embd, eps).double()
        target = tokens[i, first + 1 :]
        nll_d -= torch.log_softmax(ld, -1).gather(1, target[:, None]).sum().item()
        nll_m -= torch.log_softmax(lm, -1).gather(1, target[:, None]).sum().item()
        agree += int((ld.argmax(-1) == lm.argmax(-1)).sum().item())
        count += len(target)
    return math.exp(nll_d / count), math.exp(nll_m / count), agree / count
