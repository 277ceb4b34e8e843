// The forward with 8 rows in flight a group (the project's has 4).
#include "embedding/embedding_forward.cu"
POOLED_FORWARD(probe_forward_u8_f32, float, 8)
