"""The decoding engine: Engine, scheduler, runner and the exact speculative step."""
