"""Text generation with the weights that embed: decoding options and sampling, KV caches, the token loop,
and text streaming with stop strings."""
