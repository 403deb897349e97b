"""LightningDataModules and data IO for genrl (see docs/architecture.md, Layers)."""

from genrl.data.ode_pairs import ODEPairs, ODEPairsDataModule, load_ode_pairs, save_ode_pairs
from genrl.data.online_teacher import OnlineTeacherSpec, ShapesRendererTeacher, TeacherCache
from genrl.data.preference_pairs import PreferencePairDataModule, load_pair_set
from genrl.data.prompts import PromptDataModule, PromptRecord, load_prompts
from genrl.data.shapes import ShapeSpec, ShapesWorldConfig
from genrl.data.shapes_datamodule import ShapesDataModule, data_parallel_of, local_batch_size
from genrl.data.teacher_videos import (
    CallableTeacher,
    GeneratorTeacher,
    TeacherSource,
    TeacherVideoDataModule,
    TeacherVideoStore,
    VideoSpec,
    encode_clips,
)
from genrl.data.video_folder import VideoFolderDataModule, VideoFolderDataset, collate_videos
from genrl.data.video_io import VideoInfo, VideoReadError, probe_video, read_video, write_video

__all__ = [
    "ShapeSpec",
    "ShapesDataModule",
    "ShapesWorldConfig",
    "data_parallel_of",
    "local_batch_size",
    "VideoFolderDataModule",
    "VideoFolderDataset",
    "VideoInfo",
    "VideoReadError",
    "collate_videos",
    "probe_video",
    "read_video",
    "write_video",
    "PreferencePairDataModule",
    "load_pair_set",
    "PromptDataModule",
    "PromptRecord",
    "load_prompts",
    "ODEPairs",
    "ODEPairsDataModule",
    "load_ode_pairs",
    "save_ode_pairs",
    "CallableTeacher",
    "GeneratorTeacher",
    "OnlineTeacherSpec",
    "ShapesRendererTeacher",
    "TeacherCache",
    "TeacherSource",
    "TeacherVideoDataModule",
    "TeacherVideoStore",
    "VideoSpec",
    "encode_clips",
]
