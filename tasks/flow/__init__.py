"""The job lifecycle by phase: spec, gate, claim, admission, body, settle, and `Job` to run them."""
