"""Lightning callbacks: EMA, sample-video logging, diffusers export, the checkpoint on interruption, a step-counting
progress bar, the training-compute counter, the reward-hacking monitor."""

from genrl.callbacks.compute import ComputeCounter
from genrl.callbacks.ema import EMA, find_ema
from genrl.callbacks.export import DiffusersExport, SamplingRecord
from genrl.callbacks.hacking import RewardHackingMonitor
from genrl.callbacks.interrupt import InterruptCheckpoint, newest_last_checkpoint, resume_command
from genrl.callbacks.progress import StepProgressBar
from genrl.callbacks.video_logger import VideoLogger, filmstrip

__all__ = ["ComputeCounter", "EMA", "find_ema", "DiffusersExport", "SamplingRecord", "InterruptCheckpoint",
           "newest_last_checkpoint",
           "resume_command", "RewardHackingMonitor", "StepProgressBar", "VideoLogger", "filmstrip"]
