"""The reference workflows built on jobfence: payments, stock, their ledger, and demo faults."""
