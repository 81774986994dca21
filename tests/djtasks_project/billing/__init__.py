"""The billing app: one charge per invoice, written to billing_charge by a Django task."""
