"""What the billing app (tests/apps/billing.py) and its tests share, importable without the app's
settings: how many attempts a message gets, and the app's tables."""

ATTEMPTS = 32
SHIP_S = 0.01  # each order.shipped message takes this long
TABLES = """
CREATE TABLE IF NOT EXISTS billing_accounts (customer INT PRIMARY KEY, account TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS invoices (order_id INT PRIMARY KEY, account TEXT NOT NULL, billed_at TIMESTAMPTZ NOT NULL);
"""
