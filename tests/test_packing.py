"""Sequence packing against the diffusers pipeline's mRoPE builders and index layout."""

import pytest
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
    get_3d_mrope_ids_text_tokens,
    get_3d_mrope_ids_vae_tokens,
)

from policy_server.model.config import Cosmos3TransformerConfig
from policy_server.pipeline.packing import ActionLayout, grid_position_ids, pack_request, text_position_ids


@pytest.mark.parametrize("fps", [None, 24.0, 15.0, 5.0])
@pytest.mark.parametrize("grid", [(1, 2, 3), (3, 2, 3), (5, 1, 1)])
def test_grid_positions_match_diffusers(fps, grid):
    ours = grid_position_ids(*grid, temporal_offset=15024, fps=fps, base_fps=24.0,
                             temporal_compression=4, base_temporal_compression=4)
    ref, _ = get_3d_mrope_ids_vae_tokens(*grid, temporal_offset=15024, fps=fps, base_fps=24.0,
                                         temporal_compression_factor=4)
    assert ours.dtype == ref.dtype
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("fps", [24.0, 10.0])
def test_action_positions_align_with_next_frame(fps):
    ours = grid_position_ids(8, 1, 1, temporal_offset=100, fps=fps, base_fps=24.0, temporal_compression=1,
                             base_temporal_compression=4, start_frame_offset=1)
    ref, _ = get_3d_mrope_ids_vae_tokens(8, 1, 1, temporal_offset=100, fps=fps, base_fps=24.0,
                                         temporal_compression_factor=1, base_temporal_compression_factor=4,
                                         start_frame_offset=1)
    assert torch.equal(ours, ref)
    # Action i sits at pixel frame i+1; four pixel frames make one latent-frame unit at 24 fps.
    if fps == 24.0:
        assert ours[0, 3].item() == pytest.approx(100 + 1.0)


def test_text_positions_match_diffusers():
    ref, _ = get_3d_mrope_ids_text_tokens(7, 0, use_float_positions=True)
    assert torch.equal(text_position_ids(7, True), ref)


def _config():
    return Cosmos3TransformerConfig(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, num_hidden_layers=1, latent_channel=4,
                                    patch_latent_dim=16, vocab_size=64, rope_axes_dim=[2, 1, 1],
                                    action_gen=True, action_dim=6)


def test_policy_layout_indexes():
    cfg = _config()
    seq = pack_request(cfg, input_ids=[1, 2, 3, 4, 5], latent_shape=(4, 3, 3, 5), clean_frames=[0], fps=24.0,
                       action=ActionLayout(chunk_size=8, num_prefix=0, clean_rows=(), domain_id=4))
    per_frame = 2 * 3  # odd latent H/W are padded to the patch size
    assert seq.vision_token_shape == (3, 2, 3)
    assert seq.sequence_length == 5 + 3 * per_frame + 8
    assert seq.vision_mse_loss_indexes.tolist() == list(range(5 + per_frame, 5 + 3 * per_frame))
    assert seq.action_mse_loss_indexes.tolist() == list(range(5 + 3 * per_frame, seq.sequence_length))
    assert seq.position_ids.shape == (3, seq.sequence_length)
    assert seq.position_ids.dtype == torch.float32
    # The generation modalities start after the 15000-position modality margin.
    assert seq.position_ids[0, 5].item() == 5 + 15000


def test_state_row_is_clean_and_chunk_keeps_its_positions():
    cfg = _config()
    plain = pack_request(cfg, [1, 2], (4, 3, 2, 2), [0], 24.0, ActionLayout(8, 0, (), 4))
    with_state = pack_request(cfg, [1, 2], (4, 3, 2, 2), [0], 24.0, ActionLayout(8, 1, (0,), 4))
    assert with_state.action_noisy_rows.tolist() == list(range(1, 9))
    chunk_positions = with_state.position_ids[:, -8:]
    assert torch.equal(chunk_positions, plain.position_ids[:, -8:])
    # The state row sits at the conditioning frame's time.
    assert with_state.position_ids[0, -9].item() == pytest.approx(plain.position_ids[0, 2].item())


def test_inverse_dynamics_has_no_noisy_vision():
    cfg = _config()
    seq = pack_request(cfg, [1, 2], (4, 3, 2, 2), [0, 1, 2], 24.0, ActionLayout(8, 0, (), 4))
    assert seq.num_noisy_vision_tokens == 0
    assert seq.action_noisy_rows.numel() == 8


def test_sound_rows_sit_between_vision_and_actions():
    cfg = _config()
    seq = pack_request(cfg, [1, 2], (4, 3, 2, 2), [0], 24.0, ActionLayout(8, 0, (), 4), sound_frames=5)
    ref, _ = get_3d_mrope_ids_vae_tokens(5, 1, 1, temporal_offset=2 + 15000, fps=cfg.sound_latent_fps,
                                         base_fps=24.0, temporal_compression_factor=1)
    assert torch.equal(seq.position_ids[:, 2 + 3:2 + 3 + 5], ref.float())
    kwargs = seq.model_kwargs(torch.zeros(4, 3, 2, 2), torch.zeros(8, 6), 500.0, torch.zeros(7, 5))
    assert kwargs["sound_sequence_indexes"].tolist() == [5, 6, 7, 8, 9]
    assert seq.action_sequence_indexes.tolist()[0] == 10 and seq.sequence_length == 18
