"""Lightning callbacks: EMA, sample-video logging, diffusers export."""

from genrl.callbacks.ema import EMA, find_ema
from genrl.callbacks.export import DiffusersExport
from genrl.callbacks.video_logger import VideoLogger, filmstrip

__all__ = ["EMA", "find_ema", "DiffusersExport", "VideoLogger", "filmstrip"]
