"""robots.video: H.264 through PyAV."""

import av
import numpy as np
import pytest

from robots.video import H264Writer, read_frames, write_browser_mp4


def _gradients(count: int, height: int, width: int) -> list[np.ndarray]:
    y, x = np.mgrid[:height, :width]
    return [np.stack([(x * 3 + 10 * t) % 256, (y * 3) % 256, np.full_like(x, 40 * t)], -1).astype(np.uint8)
            for t in range(count)]


def test_browser_video_pads_odd_sides_to_even(tmp_path):
    frames = _gradients(5, 63, 65)
    write_browser_mp4(tmp_path / "v.mp4", frames, fps=10)
    with av.open(str(tmp_path / "v.mp4")) as container:
        stream = container.streams.video[0]
        assert (stream.codec_context.name, stream.pix_fmt, stream.height, stream.width) == ("h264", "yuv420p", 64, 66)
    decoded = read_frames(tmp_path / "v.mp4", 0.0, 5, fps=10)[:, :63, :65]
    error = decoded.astype(np.float64) - np.stack(frames)
    assert 10 * np.log10(255**2 / np.mean(error**2)) > 30


def test_read_frames_from_a_keyframe_and_refuses_a_short_file(tmp_path):
    frames = _gradients(12, 16, 16)
    with H264Writer(tmp_path / "v.mp4", 10, 16, 16, "yuv444p", crf=0) as writer:
        for i, frame in enumerate(frames):
            writer.write(frame, keyframe=i in (0, 7))
    assert np.abs(read_frames(tmp_path / "v.mp4", 0.7, 5, fps=10).astype(int) - frames[7:]).max() <= 2
    with pytest.raises(ValueError, match=r"holds 5 frames from 0.700 s on at 10 fps; expected 6"):
        read_frames(tmp_path / "v.mp4", 0.7, 6, fps=10)
    # A start between frames (a shifted from_timestamp) read the nearest frames: 0.66 s gave frames 7 .. 11.
    with pytest.raises(ValueError, match=r"frame at 0.7000 s is \+0.0400 s from 0.6600 s, not a whole number of "):
        read_frames(tmp_path / "v.mp4", 0.66, 5, fps=10)
    assert len(read_frames(tmp_path / "v.mp4", 0.70004, 5, fps=10)) == 5  # within LeRobot's tolerance
    with pytest.raises(ValueError, match="yuv420p needs even frame sides, got 15x16"):
        H264Writer(tmp_path / "odd.mp4", 10, 15, 16, "yuv420p", crf=23)
