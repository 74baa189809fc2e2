"""bulletserve: LLM serving with concurrent prefill and decode lanes (Bullet)."""

__version__ = "0.1.0"
