"""Paged KV-cache bookkeeping: which block holds which tokens. No tensors here."""
