"""Training: the corpus builder, one training loop with checkpoint/resume, and draft distillation
(``leapfrog train-draft``). The demo model family is made with these by ``scripts/train_demo.py``."""

from leapfrog.train.corpus import Document, pack_stream, read_documents, split_by_file, stdlib_documents
from leapfrog.train.distill import DraftShape, train_draft
from leapfrog.train.loop import TrainConfig, TrainState, train

__all__ = ["Document", "DraftShape", "TrainConfig", "TrainState", "pack_stream", "read_documents",
           "split_by_file", "stdlib_documents", "train", "train_draft"]
