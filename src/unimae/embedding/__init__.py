"""How a text becomes one vector: tokenization with EOS, attention rules, poolings, the spec that names them,
and what is done to the finished vectors."""
