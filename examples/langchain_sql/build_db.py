#!/usr/bin/env python
"""Builds shop.db (shipped in the repository; rerun only to change it): customers, products, orders."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

CUSTOMERS = [("Alice", "Paris"), ("Bob", "Lyon"), ("Chloe", "Paris"), ("David", "Berlin"), ("Emma", "Lyon"),
             ("Farid", "Madrid"), ("Grace", "Berlin"), ("Hugo", "Paris"), ("Ines", "Madrid"), ("Jonas", "Berlin")]
PRODUCTS = [("Lamp", 35), ("Chair", 60), ("Desk", 150), ("Pen", 2), ("Notebook", 5), ("Monitor", 220),
            ("Keyboard", 45), ("Mug", 8)]


def build(path: Path) -> None:
    path.unlink(missing_ok=True)
    rng = random.Random(7)
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
        CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price INTEGER NOT NULL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
                             product_id INTEGER REFERENCES products(id), quantity INTEGER NOT NULL,
                             order_date TEXT NOT NULL);
        """
    )
    db.executemany("INSERT INTO customers (name, city) VALUES (?, ?)", CUSTOMERS)
    db.executemany("INSERT INTO products (name, price) VALUES (?, ?)", PRODUCTS)
    orders = [(rng.randint(1, len(CUSTOMERS)), rng.randint(1, len(PRODUCTS)), rng.randint(1, 5),
               f"2024-{rng.randint(1, 6):02d}-{rng.randint(1, 28):02d}") for _ in range(40)]
    db.executemany("INSERT INTO orders (customer_id, product_id, quantity, order_date) VALUES (?, ?, ?, ?)", orders)
    db.commit()
    db.close()


if __name__ == "__main__":
    build(Path(__file__).with_name("shop.db"))
    print("wrote shop.db")
