"""Adaptive draft lengths: each step, how many of each request's draft
tokens are worth verifying, from live acceptance and measured step costs
(issue 27). Pure host logic: no vLLM, no proposer imports; the runner
adapters feed it (`integration/session.py`)."""
