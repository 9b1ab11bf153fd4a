"""SPLASH: serve MLA models and switch the attention layout while requests keep running."""
