"""Pure-function model code for the Kimi-Linear / Kimi-K3 family.

Einsum dimension glossary (one letter per dimension):
  B batch / sequences        T tokens (packed)         D hidden (model width)
  H heads                    K key (head) dim          V value (head) dim
  C channels / chunk size    W conv taps               L layers / latent width
  E experts                  I FFN intermediate        R MLA kv latent (kv_lora_rank)
  Q MLA q latent (q_lora)    N rope / nope head dim    P pages             S sources / slots
  X vocabulary
Weights are stored `[in, out]` so a projection reads `td,dx->tx`. Parameters of one attention
kind are stacked over its layers (leading dim), and a layer reads its slice.
"""
