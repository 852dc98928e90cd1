"""Our SeaCache against diffusers 0.42.1's SeaCache hook on the same tiny Cosmos3 model and trajectory.

diffusers is the test-only reference. Its hook reads step / sigma / step count from
``transformer.cache_context(branch, step_index=..., sigma=..., num_inference_steps=...)`` and gates on the
raw vision latents of items with noisy frames; it skips the decoder stack plus the final pathway norms. We
observe its decisions by whether decoder layer 0 ran. Our SeaCache is driven with the same latents and
sigmas, with the unhooked model's decoder stack as ``full`` (the same boundary), so both the decision
sequences and the velocity predictions must agree.
"""

import pytest
import torch
from cache_calls import run_stack

diffusers = pytest.importorskip("diffusers")
from diffusers import Cosmos3OmniTransformer  # noqa: E402
from diffusers.hooks import SeaCacheConfig as DiffusersSeaCacheConfig  # noqa: E402

from policy_server.cache.seacache import SeaCache, SeaCacheConfig  # noqa: E402

C, T, H, W, PATCH = 4, 3, 4, 6, 2
TEXT_LEN = 5
TOKENS_PER_FRAME = (H // PATCH) * (W // PATCH)
SEQ_LEN = TEXT_LEN + T * TOKENS_PER_FRAME
NOISY_FRAMES = torch.tensor([1, 2])  # frame 0 is the clean conditioning frame
NUM_STEPS = 10
BRANCHES = ("cond", "uncond")


def _tiny_model() -> Cosmos3OmniTransformer:
    torch.manual_seed(0)
    return Cosmos3OmniTransformer(
        head_dim=8, hidden_size=16, intermediate_size=32, latent_channel=C, latent_patch_size=PATCH,
        num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1, patch_latent_dim=PATCH * PATCH * C,
        vocab_size=32, rope_axes_dim=(2, 1, 1), enable_fps_modulation=False,
    ).eval()


def _trajectory(shift=5.0):
    """Scripted flow trajectory: sigmas [N] and latents [C, T, H, W] with a clean frame 0."""
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(C, T, H, W, generator=g), torch.randn(C, T, H, W, generator=g)
    t = torch.linspace(1.0, 0.0, NUM_STEPS + 1)[:-1]
    sigmas = (shift * t / (1 + (shift - 1) * t)).tolist()
    latents = []
    for s in sigmas:
        x = (1 - s) * x0 + s * eps
        x[:, 0] = x0[:, 0]
        latents.append(x)
    return sigmas, latents


def _forward_kwargs(branch, sigma, latent):
    ids = {"cond": torch.tensor([1, 2, 3, 4, 5]), "uncond": torch.tensor([1, 6, 6, 6, 7])}[branch]
    frames = NOISY_FRAMES.tolist()
    mse = [TEXT_LEN + f * TOKENS_PER_FRAME + k for f in frames for k in range(TOKENS_PER_FRAME)]
    return dict(
        input_ids=ids, text_indexes=torch.arange(TEXT_LEN),
        position_ids=torch.arange(SEQ_LEN).unsqueeze(0).expand(3, SEQ_LEN).clone(),
        und_len=TEXT_LEN, sequence_length=SEQ_LEN, vision_tokens=[latent.unsqueeze(0)],
        vision_token_shapes=[(T, H // PATCH, W // PATCH)],
        vision_sequence_indexes=torch.arange(TEXT_LEN, SEQ_LEN),
        vision_mse_loss_indexes=torch.tensor(mse),
        vision_timesteps=torch.full((len(NOISY_FRAMES) * TOKENS_PER_FRAME,), sigma * 1000.0),
        vision_noisy_frame_indexes=[NOISY_FRAMES], return_dict=False,
    )


def _run_diffusers(threshold, order, cap):
    model = _tiny_model()
    config = DiffusersSeaCacheConfig(threshold=threshold, residual_order=order, max_consecutive_cached=cap)
    model.enable_cache(config)
    ran = []
    model.layers[0].register_forward_hook(lambda *_: ran.append(True))
    sigmas, latents = _trajectory()
    decisions = {b: "" for b in BRANCHES}
    preds = {}
    with torch.no_grad():
        for i, (sigma, latent) in enumerate(zip(sigmas, latents, strict=True)):
            for b in BRANCHES:
                ran.clear()
                with model.cache_context(b, step_index=i, sigma=sigma, num_inference_steps=NUM_STEPS):
                    vision, _, _ = model(**_forward_kwargs(b, sigma, latent))
                decisions[b] += "F" if ran else "S"
                preds[(i, b)] = vision[0]
    return decisions, preds


def _run_ours(threshold, order, cap):
    """The unhooked model with its decoder stack routed through our SeaCache."""
    model = _tiny_model()
    stack = model._run_decoder_stack
    cache = SeaCache(SeaCacheConfig(threshold=threshold, residual_order=order, max_consecutive_cached=cap))
    cache.begin(NUM_STEPS)
    sigmas, latents = _trajectory()
    current = {}

    def cached_stack(und_seq, gen_seq, rotary_emb):
        und_out = und_seq  # read only at vision indexes after the text prefix, so a skip may pass it through

        def full():
            nonlocal und_out
            und_out, gen_out = stack(und_seq, gen_seq, rotary_emb)
            return gen_out

        gen_out = run_stack(cache, gen_in=gen_seq, full=full, **current)
        return und_out, gen_out

    model._run_decoder_stack = cached_stack
    preds = {}
    with torch.no_grad():
        for i, (sigma, latent) in enumerate(zip(sigmas, latents, strict=True)):
            for b in BRANCHES:
                current.update(step=i, branch=b, sigma=sigma, noisy_vision=[latent])
                vision, _, _ = model(**_forward_kwargs(b, sigma, latent))
                preds[(i, b)] = vision[0]
    rec = cache.record()
    return {b: rec.sequence(b) for b in BRANCHES}, preds


@pytest.mark.parametrize(
    "threshold, order, cap",
    [(0.3, 1, 2), (0.5, 1, 2), (0.5, 0, 0), (0.8, 1, 0), (1.0, 0, 3), (2.0, 1, 2), (3.0, 1, 0), (0.0, 1, 2)],
)
def test_decisions_and_predictions_match_diffusers_hook(threshold, order, cap):
    ref_decisions, ref_preds = _run_diffusers(threshold, order, cap)
    decisions, preds = _run_ours(threshold, order, cap)
    assert decisions == ref_decisions
    assert decisions["cond"] == decisions["uncond"]  # the indicator is shared; histories are alike here
    if threshold > 0:
        assert "S" in decisions["cond"], "trajectory too rough: no skips to compare"
    else:
        assert decisions["cond"] == "F" * NUM_STEPS
    for key, ref in ref_preds.items():
        torch.testing.assert_close(preds[key], ref, rtol=1e-5, atol=1e-5)


def test_trajectory_exercises_threshold_and_cap_refreshes():
    """Guard against a trajectory that would make the comparison trivial."""
    sigmas, latents = _trajectory()
    cache = SeaCache(SeaCacheConfig(threshold=0.5, max_consecutive_cached=0))
    cache.begin(NUM_STEPS)
    with torch.no_grad():
        for i, (s, x) in enumerate(zip(sigmas, latents, strict=True)):
            run_stack(cache, i, "cond", s, [x], torch.zeros(2), lambda: torch.ones(2))
    reasons = {d.reason for d in cache.record().decisions}
    assert {"threshold", "gate", "retention", "cache_end"} <= reasons
