"""MoEfication of one dense SwiGLU FFN (torch): shared expert, routed experts, router, scales.

Given a layer's FFN inputs x (N, d) as the MoE under construction sees them and
the outputs y it should reproduce (the dense FFN's on x, possibly pulled
towards the dense model's residual stream), `fit_layer` returns the layer's recipe:

1. the shared expert: the neurons with the largest expected squared
   contribution E[a_i^2] * |down_i|^2;
2. routed experts: the other neurons in equal groups by co-activation
   (balanced spherical k-means over each neuron's |contribution| profile);
3. a router (no bias: llama.cpp's has none) trained to rank the "true top-k"
   first: per token, the experts that alone reduce the routed residual
   (y - shared output) the most ("gain"), or the largest outputs ("norm");
4. routing weights made ~1: llama.cpp weights an expert by its softmax
   probability, so the router is written with a small logit scale (the top-k
   is unchanged, the probabilities are ~1/E) and expert down projections are
   multiplied by E;
5. the shared-expert gate: qwen2moe scales the shared expert by
   sigmoid(w . x), computed as silu(g)/g (NaN at g == 0 exactly). We use a
   small w along the mean input direction, so the gate stays within ~1% of
   1/2 for every token and is never exactly 0 in practice, and fold the
   factor 2 into the down scales: effectively a constant gate;
6. a scale per neuron on the down projection, fitted by ridge least squares
   (towards 1) with the routing above fixed, so the kept neurons absorb part
   of what the dropped ones contributed on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyspice.models.smolmoe_recipe import MoeShape

_KMEANS_ITERS = 12
_KMEANS_SAMPLE = 8192  # tokens whose activations describe a neuron for clustering
_ROUTER_BATCH = 4096
_ROUTER_LR = 1e-2
_ROUTING_LOGIT_STD = 0.02  # std of written router logits: E * softmax stays within a few % of 1
_SHEXP_GATE_LOGIT = 0.02  # typical |w . x| of the shared gate: sigmoid within 0.5% of 1/2
_RIDGE = 0.05  # ridge strength, relative to the Gram diagonal's mean


@dataclass
class LayerRecipe:
    order: torch.Tensor  # (n_ff,) int64: dense neuron index at each MoE position
    down_scale: torch.Tensor  # (n_ff,) in MoE order, as written (includes the E factor)
    router: torch.Tensor  # (E, d), as written
    shexp_gate: torch.Tensor  # (d,), as written


@dataclass
class LayerReport:
    router_recall: float  # share of the true top-k experts the router picks
    rel_error: float  # |moe - dense| / |dense| on the fitting tokens


def _importance(act: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return act.pow(2).mean(0) * down.pow(2).sum(0)


def _balanced_kmeans(features: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """Cluster rows of `features` (unit norm) into k groups of equal size; returns a label per row."""
    n = features.shape[0]
    size = n // k
    centroids = features[torch.randperm(n, generator=gen)[:k]].clone()
    labels = [0] * n
    for _ in range(_KMEANS_ITERS):
        sim = features @ centroids.T  # (n, k)
        order = torch.argsort(sim.flatten(), descending=True, stable=True).tolist()
        labels = [-1] * n
        fill = [0] * k
        placed = 0
        for flat in order:  # greedy: most similar (neuron, cluster) pairs first, clusters capped
            i, c = divmod(flat, k)
            if labels[i] < 0 and fill[c] < size:
                labels[i] = c
                fill[c] += 1
                placed += 1
                if placed == n:
                    break
        label_t = torch.tensor(labels)
        for c in range(k):
            centroids[c] = torch.nn.functional.normalize(features[label_t == c].mean(0), dim=0)
    return torch.tensor(labels)


def _expert_scores(act: torch.Tensor, down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """|output of each routed expert|^2 per token: (N, E); groups: (E, width) neuron indices.

    |D_e a_e|^2 = a_e . (D_e^T D_e) a_e: a (width x width) Gram per expert
    instead of materialising every expert's output.
    """
    e, width = groups.shape
    dg = down[:, groups.flatten()].view(-1, e, width).permute(1, 2, 0)  # (E, width, d)
    gram = dg @ dg.transpose(1, 2)  # (E, width, width)
    a = act[:, groups.flatten()].view(-1, e, width)
    return (torch.einsum("new,evw->nev", a, gram) * a).sum(-1)


def _expert_gains(
    act: torch.Tensor, down: torch.Tensor, groups: torch.Tensor, rest: torch.Tensor
) -> torch.Tensor:
    """How much adding each routed expert alone reduces |rest|^2 (rest: what the routed experts
    must produce): 2 <out_e, rest> - |out_e|^2, per token (N, E). Unlike the norm, it prefers
    experts whose output points where the target does."""
    e, width = groups.shape
    dg = down[:, groups.flatten()].view(-1, e, width).permute(1, 2, 0)  # (E, width, d)
    gains = torch.empty(act.shape[0], e)
    step = 2048
    for i in range(0, act.shape[0], step):
        a = act[i : i + step, groups.flatten()].view(-1, e, width)
        out = torch.einsum("new,ewd->ned", a, dg)
        gains[i : i + step] = 2 * (out * rest[i : i + step, None, :]).sum(-1) - out.pow(2).sum(-1)
    return gains


def _train_router(
    x: torch.Tensor, scores: torch.Tensor, k: int, gen: torch.Generator, steps: int, positive_scores: bool
) -> torch.Tensor:
    """A bias-free linear router (E, d) whose logits rank the true top-k first.

    Inputs are rescaled per dimension for conditioning (folded back at the end;
    no centring, which would need a bias). Initialised by ridge regression onto
    standardised log-scores, then trained with a cross-entropy against the
    true top-k set (uniform over it) with a learned temperature.
    """
    n, d = x.shape
    e = scores.shape[1]
    s = x.pow(2).mean(0).sqrt().clamp_min(1e-6)
    xs = x / s
    target_log = scores.clamp_min(1e-12).log() if positive_scores else scores
    target_log = (target_log - target_log.mean(1, keepdim=True)) / target_log.std(1, keepdim=True).clamp_min(
        1e-6
    )
    gram = xs.T @ xs + 1e-2 * n * torch.eye(d)
    w = torch.linalg.solve(gram.double(), (xs.T @ target_log).double()).float().T.contiguous()  # (E, d)
    topk = torch.topk(scores, k, dim=1).indices
    target = torch.zeros(n, e).scatter_(1, topk, 1.0 / k)
    w = w.requires_grad_(True)
    log_temp = torch.zeros((), requires_grad=True)
    opt = torch.optim.Adam([w, log_temp], lr=_ROUTER_LR)
    for _ in range(steps):
        batch = torch.randint(0, n, (min(_ROUTER_BATCH, n),), generator=gen)
        logits = (xs[batch] @ w.T) * log_temp.exp()
        loss = -(target[batch] * torch.log_softmax(logits, -1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    scaled: torch.Tensor = (w.detach() / s).contiguous()
    return scaled


def fit_layer(
    x: torch.Tensor,
    act: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    shape: MoeShape,
    seed: int,
    router_steps: int,
    router_target: str = "norm",
) -> tuple[LayerRecipe, LayerReport, torch.Tensor]:
    """The recipe of one layer, its report, and the MoE's output on x (as llama.cpp computes it)."""
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    n_ff = act.shape[1]
    e, width, k = shape.n_expert, shape.n_ff_exp, shape.n_expert_used

    importance = _importance(act, down)
    ranked = torch.argsort(importance, descending=True, stable=True)
    shared = torch.sort(ranked[: shape.n_ff_shexp]).values
    routed = torch.sort(ranked[shape.n_ff_shexp :]).values

    sample = torch.randperm(n, generator=gen)[: min(_KMEANS_SAMPLE, n)]
    profile = (act[sample][:, routed].abs() * down[:, routed].norm(dim=0)).T  # (routed, sample)
    labels = _balanced_kmeans(torch.nn.functional.normalize(profile, dim=1), e, gen)
    groups = torch.stack([torch.sort(routed[labels == c]).values for c in range(e)])  # (E, width)

    if router_target == "gain":
        rest = y - act[:, shared] @ down[:, shared].T
        scores = _expert_gains(act, down, groups, rest)
    else:
        scores = _expert_scores(act, down, groups)
    router = _train_router(x, scores, k, gen, router_steps, router_target != "gain")

    # written router: the same ranking at a small logit scale, so E * softmax ~ 1
    logits = x @ router.T
    router = router * (_ROUTING_LOGIT_STD / logits.std().clamp_min(1e-12))
    logits = x @ router.T
    chosen = torch.topk(logits, k, dim=1).indices
    weights = torch.softmax(logits, -1).gather(1, chosen) * e
    true_top = torch.topk(scores, k, dim=1).indices
    recall = (chosen[:, :, None] == true_top[:, None, :]).any(-1).float().mean().item()

    mean_dir = torch.nn.functional.normalize(x.mean(0), dim=0)
    shexp_gate = mean_dir * (_SHEXP_GATE_LOGIT / (x @ mean_dir).abs().mean().clamp_min(1e-12))
    gate = torch.sigmoid(x @ shexp_gate)  # what llama.cpp multiplies the shared expert by

    order = torch.cat([shared, groups.flatten()])
    # per-token multiplier of each neuron (MoE order): the shared gate, or the routing weight, or 0
    mult = torch.zeros(n, n_ff)
    mult[:, : shape.n_ff_shexp] = gate[:, None]
    routed_mult = torch.zeros(n, e)
    routed_mult.scatter_(1, chosen, weights)
    mult[:, shape.n_ff_shexp :] = routed_mult.repeat_interleave(width, dim=1)
    a = act[:, order] * mult
    dm = down[:, order]
    gram = (a.T @ a).double() * (dm.T @ dm).double()
    rhs = (a * (y @ dm)).sum(0).double()
    # the starting point: each neuron as in the dense model, corrected for the gate / weight factors
    base = torch.cat([torch.full((shape.n_ff_shexp,), 2.0), torch.ones(n_ff - shape.n_ff_shexp)]).double()
    lam = _RIDGE * gram.diagonal().mean()
    scale = torch.linalg.solve(gram + lam * torch.eye(n_ff, dtype=torch.float64), rhs + lam * base).float()

    out = (a * scale) @ dm.T
    rel = ((out - y).norm() / y.norm().clamp_min(1e-12)).item()
    # llama.cpp multiplies routed outputs by softmax p = weight / E: the E goes into the weights
    written = scale.clone()
    written[shape.n_ff_shexp :] *= e
    recipe = LayerRecipe(order=order, down_scale=written, router=router, shexp_gate=shexp_gate)
    return recipe, LayerReport(router_recall=recall, rel_error=rel), out


def apply_layer(
    x: torch.Tensor, act: torch.Tensor, down: torch.Tensor, r: LayerRecipe, shape: MoeShape
) -> torch.Tensor:
    """The MoE layer's output on x, computed as llama.cpp's qwen2moe graph does (in F32)."""
    n = x.shape[0]
    e, width, k = shape.n_expert, shape.n_ff_exp, shape.n_expert_used
    logits = x @ r.router.T
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(logits, k, dim=1).indices
    mult = torch.zeros(n, act.shape[1])
    mult[:, : shape.n_ff_shexp] = torch.sigmoid(x @ r.shexp_gate)[:, None]
    routed_mult = torch.zeros(n, e).scatter_(1, chosen, probs.gather(1, chosen))
    mult[:, shape.n_ff_shexp :] = routed_mult.repeat_interleave(width, dim=1)
    return (act[:, r.order] * mult * r.down_scale) @ down[:, r.order].T
