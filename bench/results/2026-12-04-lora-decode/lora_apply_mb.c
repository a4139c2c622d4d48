#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void loops(const float*A,const float*B,const float*x,float*y,int r,int ni,int no,float*u){
  for(int j=0;j<r;j++){const float*a=A+(size_t)j*ni;float acc=0;
#pragma omp simd reduction(+:acc)
    for(int c=0;c<ni;c++)acc+=a[c]*x[c]; u[j]=2*acc;}
  for(int o=0;o<no;o++){const float*b=B+(size_t)o*r;float acc=0;
#pragma omp simd reduction(+:acc)
    for(int j=0;j<r;j++)acc+=b[j]*u[j]; y[o]+=acc;}
}
int main(){int r=8; int ni[4]={576,576,576,576}, no[4]={576,192,192,576};
 float *A[120],*B[120]; for(int i=0;i<120;i++){int t=i%4;A[i]=malloc(4*r*ni[t]);B[i]=malloc(4*r*no[t]);for(int k=0;k<r*ni[t];k++)A[i][k]=rand()/(float)RAND_MAX;for(int k=0;k<r*no[t];k++)B[i][k]=rand()/(float)RAND_MAX;}
 float x[576],y[576],u[8]; for(int k=0;k<576;k++)x[k]=1e-3f*k;
 for(int mode=0;mode<2;mode++) for(int rep=0;rep<3;rep++){double t0=now(); for(int it=0;it<1000;it++) for(int i=0;i<120;i++){int t=i%4;
   if(mode==0){cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,1,r,ni[t],1,x,ni[t],A[i],ni[t],0,u,r);cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasTrans,1,no[t],r,2,u,r,B[i],r,1,y,no[t]);}
   else loops(A[i],B[i],x,y,r,ni[t],no[t],u);}
   printf("%s: %.1f us per token (120 targets)\n", mode?"loops":"sgemm", (now()-t0)*1e3);}
}
