set terminal pngcairo noenhanced font 'sans,10' size 1000,620
set grid
set key outside right top
set logscale x 2
set xtics ("1K" 1024, "2K" 2048, "4K" 4096, "8K" 8192, "16K" 16384, "32K" 32768, "64K" 65536)
set xrange [853.333:78643.2]
set pointsize 0.8
set output 'bench/results/long-sweep/prefill.png'
set title 'Prefill time vs context length - 2026-11-30, 2 thread(s)'
set xlabel 'prompt length (tokens)'
set ylabel 'seconds (log)'
set logscale y
plot 'bench/results/long-sweep/plot/prefill-0.dat' using 1:2 with linespoints lw 2  lc rgb '#1f77b4' title 'softmax', \
     'bench/results/long-sweep/plot/prefill-1.dat' using 1:2 with linespoints lw 2  lc rgb '#ff7f0e' title 'swa (window 896)', \
     'bench/results/long-sweep/plot/prefill-2.dat' using 1:2 with linespoints lw 2  lc rgb '#2ca02c' title 'lolcats', \
     'bench/results/long-sweep/plot/prefill-3.dat' using 1:2 with linespoints lw 2  lc rgb '#9467bd' title 'liger', \
     'bench/results/long-sweep/plot/prefill-4.dat' using 1:2 with linespoints lw 2  lc rgb '#d62728' title 'still', \
     'bench/results/long-sweep/plot/prefill-5.dat' using 1:2 with linespoints lw 2  lc rgb '#000000' title 'llama.cpp'
unset output
set output 'bench/results/long-sweep/decode.png'
set title 'Decode time per token vs context depth (32 tokens after the context) - 2026-11-30, 2 thread(s)'
set xlabel 'context depth (tokens)'
set ylabel 'ms / token'
unset logscale y
plot 'bench/results/long-sweep/plot/decode-0.dat' using 1:2 with linespoints lw 2  lc rgb '#1f77b4' title 'softmax', \
     'bench/results/long-sweep/plot/decode-1.dat' using 1:2 with linespoints lw 2  lc rgb '#ff7f0e' title 'swa (window 896)', \
     'bench/results/long-sweep/plot/decode-2.dat' using 1:2 with linespoints lw 2  lc rgb '#2ca02c' title 'lolcats', \
     'bench/results/long-sweep/plot/decode-3.dat' using 1:2 with linespoints lw 2  lc rgb '#9467bd' title 'liger', \
     'bench/results/long-sweep/plot/decode-4.dat' using 1:2 with linespoints lw 2  lc rgb '#d62728' title 'still', \
     'bench/results/long-sweep/plot/decode-5.dat' using 1:2 with linespoints lw 2  lc rgb '#000000' title 'llama.cpp'
unset output
set output 'bench/results/long-sweep/memory.png'
set title 'Memory vs context length: peak RSS (solid), attention state (dashed) - 2026-11-30, 2 thread(s)'
set xlabel 'context length (tokens)'
set ylabel 'MiB (log)'
set logscale y
plot 'bench/results/long-sweep/plot/rss-0.dat' using 1:2 with linespoints lw 2  lc rgb '#1f77b4' title 'softmax RSS', \
     'bench/results/long-sweep/plot/rss-1.dat' using 1:2 with linespoints lw 2  lc rgb '#ff7f0e' title 'swa (window 896) RSS', \
     'bench/results/long-sweep/plot/rss-2.dat' using 1:2 with linespoints lw 2  lc rgb '#2ca02c' title 'lolcats RSS', \
     'bench/results/long-sweep/plot/rss-3.dat' using 1:2 with linespoints lw 2  lc rgb '#9467bd' title 'liger RSS', \
     'bench/results/long-sweep/plot/rss-4.dat' using 1:2 with linespoints lw 2  lc rgb '#d62728' title 'still RSS', \
     'bench/results/long-sweep/plot/rss-5.dat' using 1:2 with linespoints lw 2  lc rgb '#000000' title 'llama.cpp RSS', \
     'bench/results/long-sweep/plot/state-0.dat' using 1:2 with linespoints lw 2 dt 2 lc rgb '#1f77b4' title 'softmax state', \
     'bench/results/long-sweep/plot/state-1.dat' using 1:2 with linespoints lw 2 dt 2 lc rgb '#ff7f0e' title 'swa (window 896) state', \
     'bench/results/long-sweep/plot/state-2.dat' using 1:2 with linespoints lw 2 dt 2 lc rgb '#2ca02c' title 'lolcats state', \
     'bench/results/long-sweep/plot/state-3.dat' using 1:2 with linespoints lw 2 dt 2 lc rgb '#9467bd' title 'liger state', \
     'bench/results/long-sweep/plot/state-4.dat' using 1:2 with linespoints lw 2 dt 2 lc rgb '#d62728' title 'still state'
unset output
