"""What a rollout video must be for a browser to play it."""

import av


def assert_browser_playable(path, frames: int) -> None:
    """H.264 High profile in 4:2:0 (what browsers decode), one frame per step, the real scene beside the
    prediction (128 px each)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context
        assert (codec.name, codec.profile, stream.pix_fmt) == ("h264", "High", "yuv420p")
        assert (stream.height, stream.width) == (128, 256)
        decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    assert len(decoded) == frames
    assert min(frame[:, 128:].mean() for frame in decoded) > 8  # predicted frames, not the black placeholder
