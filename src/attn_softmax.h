/* Constants of the tiled softmax attention (softmax and swa kinds). */
#ifndef STILL_ATTN_SOFTMAX_H
#define STILL_ATTN_SOFTMAX_H

#define ATT_BLOCK 64             /* keys per tile; also the cache's block */
#define ATT_MAX_HEAD_DIM 256     /* checked when a model is loaded */

#endif
