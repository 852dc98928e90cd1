"""H.264 MP4 files through PyAV: browser-playable rollout videos and the frames of LeRobot datasets.

Two pixel formats, for two readers:
    ``yuv420p``  what browsers play (High profile); even width and height.
    ``yuv444p``  full-resolution colour (High 4:4:4 Predictive), for training data: at 64x64, 4:2:0
                 halves the colour resolution of discs a few pixels wide and caps PSNR near 33 dB.
Frame i is shown at ``i / fps`` seconds.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter

BROWSER_PIX_FMT = "yuv420p"
FRAME_TIME_TOLERANCE_S = 1e-4  # between a decoded frame's time and the one asked for, as LeRobot's tolerance_s


class H264Writer:
    """Appends uint8 RGB frames [H, W, 3] to an H.264 MP4. ``crf``: libx264 quality (0: lossless in YUV,
    23: its default). Use as a context manager; the file is complete once closed."""

    def __init__(self, path: str | Path, fps: int, height: int, width: int, pix_fmt: str, crf: int):
        if pix_fmt == BROWSER_PIX_FMT and (height % 2 or width % 2):
            raise ValueError(f"{pix_fmt} needs even frame sides, got {height}x{width}")
        # faststart: the index goes before the frames, so a browser starts playing before the download ends.
        self.container = av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"})
        self.stream = self.container.add_stream("libx264", rate=fps)
        self.stream.height, self.stream.width, self.stream.pix_fmt = height, width, pix_fmt
        self.stream.options = {"crf": str(crf)}
        self.frames_written = 0
        self.bytes_written = 0  # of encoded frames muxed so far (the encoder holds back its last few)

    def write(self, frame: np.ndarray, keyframe: bool = False) -> None:
        """``keyframe``: start a new group of pictures here, so that decoding can begin at this frame."""
        picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        picture.pts = self.frames_written
        if keyframe:
            picture.pict_type = av.video.frame.PictureType.I
        packets = self.stream.encode(picture)
        self.bytes_written += sum(packet.size for packet in packets)
        self.container.mux(packets)
        self.frames_written += 1

    def close(self) -> None:
        self.container.mux(self.stream.encode())  # flush the frames the encoder still holds
        self.container.close()

    def __enter__(self) -> H264Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_browser_mp4(path: str | Path, frames: list[np.ndarray], fps: int) -> None:
    """Write RGB frames [H, W, 3] as a video browsers play; odd sides are padded by one edge pixel."""
    height, width = frames[0].shape[:2]
    pad = ((0, height % 2), (0, width % 2), (0, 0))
    with H264Writer(path, fps, height + height % 2, width + width % 2, BROWSER_PIX_FMT, crf=23) as writer:
        for frame in frames:
            writer.write(np.pad(frame, pad, mode="edge"))


def read_frames(path: str | Path, start_s: float, count: int, fps: float) -> np.ndarray:
    """The ``count`` frames shown from ``start_s`` seconds on, one every ``1 / fps`` s, uint8 RGB [count, H, W, 3].
    Raises ValueError if the file holds fewer, frames at another rate, or no video PyAV decodes."""
    frames = []
    to_rgb = VideoReformatter()  # keeps its colour-conversion context from frame to frame (5x faster)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ValueError(f"{path} holds no video stream; expected the camera's frames")
            stream = container.streams.video[0]
            container.seek(round(start_s / stream.time_base), stream=stream)  # the keyframe at or before start_s
            for picture in container.decode(stream):
                index = round((picture.time - start_s) * fps)
                if index >= count:
                    break
                if index >= 0 and index != len(frames):  # a video of another rate repeats or skips frame numbers
                    raise ValueError(f"{path}: its frame at {picture.time:.3f} s is frame {index} from {start_s:.3f} s "
                                     f"at {fps} fps, after {len(frames)}; expected a frame every 1/{fps} s")
                if index >= 0 and abs(picture.time - start_s - index / fps) > FRAME_TIME_TOLERANCE_S:
                    # A start between two frames (a shifted from_timestamp): the nearest ones are another episode's.
                    raise ValueError(f"{path}: its frame at {picture.time:.4f} s is {picture.time - start_s:+.4f} s "
                                     f"from {start_s:.4f} s, not a whole number of frames at {fps} fps; expected "
                                     f"frames at {start_s:.4f} s + i/{fps} s, within {FRAME_TIME_TOLERANCE_S} s")
                if index >= 0:
                    frames.append(to_rgb.reformat(picture, format="rgb24").to_ndarray())
    except av.FFmpegError as error:  # not a video, cut short, or a codec this FFmpeg does not decode
        raise ValueError(f"{path} is not a video PyAV decodes ({error.strerror or error})") from None
    if len(frames) != count:
        raise ValueError(f"{path} holds {len(frames)} frames from {start_s:.3f} s on at {fps} fps; expected {count}")
    return np.stack(frames)
