"""The lock-backend contract: one suite run against every LockBackend."""
