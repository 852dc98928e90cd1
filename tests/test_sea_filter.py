"""SEA filter: the spec's §1.9 vectors, normalisation, limits, caching, and an independent numpy reference."""

import numpy as np
import pytest
import torch

from policy_server.cache.sea_filter import SeaFilter, axis_gain, flow_ab, rel_l1


def test_axis_gain_matches_spec_vectors_sigma_0_9():
    expected = [10.0, 8.6341, 4.4138, 1.8970, 0.8989, 1.8970, 4.4138, 8.6341]
    assert axis_gain(8, 0.9, 3.0).tolist() == pytest.approx(expected, abs=1e-4)


def test_axis_gain_matches_spec_vectors_sigma_0_5():
    expected = [2.0, 1.9961, 1.9692, 1.8998, 1.7778, 1.8998, 1.9692, 1.9961]
    assert axis_gain(8, 0.5, 3.0).tolist() == pytest.approx(expected, abs=1e-4)


def test_the_normalised_gain_matches_the_spec_on_a_2x4x4_grid():
    raw = (
        axis_gain(2, 0.9, 3.0).reshape(2, 1, 1)
        * axis_gain(4, 0.9, 3.0).reshape(1, 4, 1)
        * axis_gain(4, 0.9, 3.0).reshape(1, 1, 4)
    )
    assert raw.mean().item() == pytest.approx(132.535, abs=1e-3)
    # The filter scales each frequency by its normalised gain: DC (a constant) by the largest, 7.5452, the
    # Nyquist frequency of every axis (signs alternating along each) by the smallest, 0.0054799.
    sea = SeaFilter()
    constant = torch.ones(1, 2, 4, 4)
    torch.testing.assert_close(sea.indicator(constant, 0.9), 7.5452 * constant.movedim(0, -1), rtol=1e-4, atol=0)
    t, h, w = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    alternating = ((-1.0) ** (t + h + w)).unsqueeze(0)
    torch.testing.assert_close(sea.indicator(alternating, 0.9), 0.0054799 * alternating.movedim(0, -1),
                               rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("sigma", [0.999, 0.9, 0.7, 0.5, 0.1])
def test_normalised_gain_has_unit_mean(sigma):
    # A unit impulse keeps at its own position the mean of the gains over every frequency.
    impulse = torch.zeros(1, 3, 6, 10)
    impulse[0, 0, 0, 0] = 1.0
    assert SeaFilter().indicator(impulse, sigma)[0, 0, 0, 0].item() == pytest.approx(1.0, abs=1e-5)


def test_sigma_is_clamped_away_from_0_and_1():
    assert flow_ab(0.0) == pytest.approx((1.0 - 1e-6, 1e-6))
    assert flow_ab(1.0) == pytest.approx((1e-6, 1.0 - 1e-6))
    assert flow_ab(0.25) == (0.75, 0.25)


def test_filter_is_near_identity_as_sigma_goes_to_zero():
    x = torch.randn(4, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    y = SeaFilter().indicator(x, 0.0)
    assert y.shape == (3, 6, 8, 4)
    torch.testing.assert_close(y, x.movedim(0, -1), atol=1e-5, rtol=1e-5)


def test_high_sigma_keeps_low_frequencies_and_suppresses_high_ones():
    t = torch.arange(16, dtype=torch.float32)
    low = torch.cos(2 * torch.pi * t / 16).reshape(1, 1, 1, 16).expand(1, 1, 4, 16)
    high = torch.cos(torch.pi * t).reshape(1, 1, 1, 16).expand(1, 1, 4, 16)
    sea = SeaFilter()
    ratio_low = sea.indicator(low, 0.95).abs().mean() / low.abs().mean()
    ratio_high = sea.indicator(high, 0.95).abs().mean() / high.abs().mean()
    assert ratio_low > 10 * ratio_high


def test_single_frame_latent_reduces_to_a_2d_filter_over_h_w():
    x = torch.randn(3, 1, 6, 10, generator=torch.Generator().manual_seed(1))
    y = SeaFilter().indicator(x, 0.8)
    assert y.shape == (1, 6, 10, 3)
    gain_hw = axis_gain(6, 0.8, 3.0).reshape(6, 1) * axis_gain(10, 0.8, 3.0).reshape(1, 10)
    gain_hw = gain_hw / gain_hw.mean()
    expected = torch.fft.ifft2(torch.fft.fft2(x[:, 0]) * gain_hw).real  # [C, H, W]
    torch.testing.assert_close(y[0], expected.movedim(0, -1), atol=1e-5, rtol=1e-5)


def _numpy_sea(latent_cthw: np.ndarray, sigma: float, p: float) -> np.ndarray:
    """Independent float64 reference of the spec's formula."""
    a, b = 1.0 - sigma, sigma
    x = np.moveaxis(latent_cthw, 0, -1)
    gain = np.ones(x.shape[:3])
    for axis, n in enumerate(x.shape[:3]):
        f = np.abs(np.fft.fftfreq(n))
        s = 1.0 / (f**p + 1e-16)
        g = a * s / (a * a * s + b * b + 1e-16)
        shape = [1, 1, 1]
        shape[axis] = n
        gain = gain * g.reshape(shape)
    gain = gain / gain.mean()
    return np.real(np.fft.ifftn(np.fft.fftn(x, axes=(0, 1, 2)) * gain[..., None], axes=(0, 1, 2)))


@pytest.mark.parametrize("sigma", [0.95, 0.6, 0.2])
def test_filter_matches_numpy_reference(sigma):
    x = torch.randn(5, 3, 6, 7, generator=torch.Generator().manual_seed(2))
    got = SeaFilter().indicator(x, sigma).double().numpy()
    want = _numpy_sea(x.double().numpy(), sigma, 3.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_output_keeps_input_dtype_and_computes_in_fp32():
    x = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    y16 = SeaFilter().indicator(x.to(torch.bfloat16), 0.7)
    assert y16.dtype == torch.bfloat16
    y32 = SeaFilter().indicator(x.to(torch.bfloat16).float(), 0.7)
    torch.testing.assert_close(y16.float(), y32, atol=0.05, rtol=0.02)


def test_filters_are_cached_per_shape_and_sigma():
    sea = SeaFilter(max_filters=3)
    f1 = sea.filters((2, 4, 4), 0.9, "cpu")
    assert sea.filters((2, 4, 4), 0.9, "cpu") is f1  # a repeated request reuses the cached tensors
    f2 = sea.filters((2, 4, 4), 0.8, "cpu")
    f3 = sea.filters((2, 4, 8), 0.9, "cpu")
    assert f2 is not f1 and f3 is not f1  # sigma and grid are both part of the key
    sea.filters((1, 4, 4), 0.9, "cpu")  # a fourth set: the least recently used one (f1) is dropped
    assert sea.filters((2, 4, 4), 0.8, "cpu") is f2
    assert sea.filters((2, 4, 8), 0.9, "cpu") is f3
    again = sea.filters((2, 4, 4), 0.9, "cpu")
    assert again is not f1  # recomputed after eviction, to the same values
    for got, want in zip(again, f1, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_filter_rejects_bad_shapes_and_parameters():
    with pytest.raises(ValueError, match=r"\[C, T, H, W\]"):
        SeaFilter().indicator(torch.zeros(3, 4, 4), 0.5)
    with pytest.raises(ValueError, match="power_exp"):
        SeaFilter(power_exp=0.0)


def test_rel_l1_values():
    prev = torch.full((2, 3), 2.0)
    assert rel_l1(prev + 1.0, prev) == pytest.approx(0.5)
    assert rel_l1(prev, prev) == 0.0
    assert rel_l1(torch.ones(3), torch.zeros(3)) == pytest.approx(1e16)
    with pytest.raises(ValueError, match="equal shapes"):
        rel_l1(torch.ones(3), torch.ones(4))


def test_rel_l1_reduces_in_fp32_for_half_inputs():
    prev = torch.full((1000,), 1.0, dtype=torch.bfloat16)
    cur = prev + torch.tensor(0.25, dtype=torch.bfloat16)
    assert isinstance(rel_l1(cur, prev), float)
    assert rel_l1(cur, prev) == pytest.approx(0.25)
