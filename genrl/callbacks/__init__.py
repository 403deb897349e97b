"""Lightning callbacks: EMA, sample-video logging, diffusers export, the checkpoint on interruption, a step-counting
progress bar."""

from genrl.callbacks.ema import EMA, find_ema
from genrl.callbacks.export import DiffusersExport, SamplingRecord
from genrl.callbacks.interrupt import InterruptCheckpoint, newest_last_checkpoint, resume_command
from genrl.callbacks.progress import StepProgressBar
from genrl.callbacks.video_logger import VideoLogger, filmstrip

__all__ = ["EMA", "find_ema", "DiffusersExport", "SamplingRecord", "InterruptCheckpoint", "newest_last_checkpoint",
           "resume_command",            "StepProgressBar", "VideoLogger", "filmstrip"]
