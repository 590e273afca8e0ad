"""Checkpoints: per_rank (each rank's own files, swapped in atomically, layout checked on resume) and
portable (one DCP checkpoint under the plain model's names, resumed by any strategy at any size)."""
