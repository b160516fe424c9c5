"""Corpora and their formats, tokenizers, token files, per-process batches."""
