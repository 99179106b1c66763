"""Glue between vLLM's engine and our proposers: config translation (front
end) and the drafter adapter (worker). Only `patches/` calls into here from
vLLM; proposers never see vLLM objects."""
