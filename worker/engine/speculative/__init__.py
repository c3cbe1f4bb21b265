"""Speculative decoding: a decoding sequence's next tokens are drafted cheaply (`ngram`), the
step's one forward pass computes the target's logits at its last token and at every draft
(attending as decoding does: worker/model/attention.py), and the engine keeps the longest
prefix of drafts the target's own choices agree with, plus the target's next token
(`verify`). Whether a step drafts, and how much, follows its measured costs and each
sequence's recent acceptance (`policy`)."""
