/*
 * A fake libnvidia-ml.so.1 for testing polca's NVML backend through the real, unmodified
 * pynvml binding (nvidia-ml-py 13.615.71) on machines without a GPU.
 *
 * Build: gcc -shared -fPIC -O2 -o <dir>/libnvidia-ml.so.1 fake_nvml.c -lpthread
 *
 * State lives in a text file, one "key value" per line, named by fakeNvmlSetStatePath()
 * or, when that was never called, by the FAKE_NVML_STATE environment variable. Every writer
 * replaces the file (temp file + rename, under an flock on "<path>.lock") and then bumps an
 * 8-byte counter in "<path>.gen", which the library maps and checks on every call: a test
 * in another process can change power, temperatures or inject errors while the agent runs,
 * and the check costs a memory read. (The file is also stat()ed every 100 ms, so a hand
 * edit shows up too.) Successful set calls write the whole state back the same way, so the
 * test can see what the agent applied. Without a readable
 * state file, initialisation fails with NVML_ERROR_DRIVER_NOT_LOADED, like a machine that
 * has the library but no driver.
 *
 * Keys (see tests/fake_nvml/__init__.py for the Python side):
 *   count N | driver_version S | privileged 0/1 | fail.<function> CODE
 *   write_delay_ms N        every set call takes N ms before it applies (a slow driver)
 *   gpu.<i>.<field> VALUE   numeric fields below; "none" makes the read NOT_SUPPORTED
 *   gpu.<i>.name / uuid / pci_bus_id S
 *   gpu.<i>.supported_mem_clocks / supported_sm_clocks  N N N ...
 *   gpu.<i>.error CODE      every call on that GPU (handle lookup included) returns CODE
 *   gpu.<i>.fail.<function> CODE, gpu.<i>.field_fail.<field id> CODE
 *
 * Health counters: gpu.<i>.ecc_{sbe,dbe}_{vol,agg}, retired_{sbe,dbe,pending}, pcie_replay,
 * remapped_{cor,unc,pending,failure}, {sw,hw}_thermal_ns and power_brake_ns are the field
 * values NVML reads by id (3-6, 29-31, 94, 142-145, 269-271). XID events: each rise of
 * gpu.<i>.xid_count is one event of code gpu.<i>.xid_code for every event set the GPU is
 * registered in (counted from its count at registration); xid_count none: no XID events.
 *
 * MIG (Multi-Instance GPU): gpu.<i>.mig_mode 0/1 ("none": the GPU has no MIG, GetMigMode is
 * NOT_SUPPORTED), mig_pending 0/1, max_mig_devices N (what GetMaxMigDeviceCount reports while
 * MIG is on; 0 otherwise, as nvml.h says). MIG devices: gpu.<i>.mig.<k>.uuid / profile S and
 * gpu.<i>.mig.<k>.gi / ci / memory_mib N, for MIG device index k < 8; a slot without a uuid
 * is empty (GetMigDeviceHandleByIndex: NOT_FOUND). MIG handles answer GetUUID, GetName
 * ("<parent name> MIG <profile>"), GetMemoryInfo, IsMigDeviceHandle,
 * GetDeviceHandleFromMigDeviceHandle and Get{Gpu,Compute}InstanceId; any other call on one is
 * INVALID_ARGUMENT. While mig_mode is 1, clock control is refused with NOT_SUPPORTED
 * (Set/ResetGpuLockedClocks, Set/ResetApplicationsClocks) and so is GetUtilizationRates;
 * power limits work as without MIG (they belong to the physical GPU).
 *
 * Physics (deliberately trivial): enforced limit = min(power_limit_mw, external_limit_mw);
 * reported power = min(configured power, enforced limit); reported SM clock = configured
 * clock clamped into the locked range. Clock event reasons gain SW_POWER_CAP (0x4) while
 * the configured power exceeds the enforced limit, and APPLICATIONS_CLOCKS_SETTING (0x2)
 * while a lock holds the SM clock below the configured clock. The energy counter is static.
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_DEVICE_MIG_ENABLE = 1,
};

enum { VT_DOUBLE = 0, VT_UINT = 1, VT_ULONG = 2, VT_ULL = 3, VT_SLL = 4, VT_SINT = 5 };

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    uint32_t fieldId;
    uint32_t scopeId;
    int64_t timestamp;
    int64_t latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned int version;
    int sensorType;
    int temperature;
} nvmlTemperature_v1_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version;
    unsigned int powerScope;
    unsigned int powerValueMw;
} nvmlPowerValue_v2_t;

#define TEMPERATURE_V1 0x100000Cu
#define POWER_VALUE_V2 0x0200000Cu
#define CLOCK_LIMIT_ID_RANGE_START 0xffffff00u

#define MAX_GPUS 64
#define MAX_CLOCKS 256
#define MAX_FIELD_FAILS 16
#define MAX_MIG 8 /* MIG device slots per GPU (A100/H100/H200/B200 have at most 7) */
#define NONE LLONG_MIN

#define FAKE_FUNCTIONS(X)                                                                    \
    X(nvmlInitWithFlags)                                                                     \
    X(nvmlInit_v2)                                                                           \
    X(nvmlShutdown)                                                                          \
    X(nvmlSystemGetDriverVersion)                                                            \
    X(nvmlDeviceGetCount_v2)                                                                 \
    X(nvmlDeviceGetHandleByIndex_v2)                                                         \
    X(nvmlDeviceGetUUID)                                                                     \
    X(nvmlDeviceGetName)                                                                     \
    X(nvmlDeviceGetPciInfo_v3)                                                               \
    X(nvmlDeviceGetPowerUsage)                                                               \
    X(nvmlDeviceGetFieldValues)                                                              \
    X(nvmlDeviceGetTotalEnergyConsumption)                                                   \
    X(nvmlDeviceGetTemperatureV)                                                             \
    X(nvmlDeviceGetClockInfo)                                                                \
    X(nvmlDeviceGetMaxClockInfo)                                                             \
    X(nvmlDeviceGetSupportedMemoryClocks)                                                    \
    X(nvmlDeviceGetSupportedGraphicsClocks)                                                  \
    X(nvmlDeviceGetUtilizationRates)                                                         \
    X(nvmlDeviceGetPowerManagementLimit)                                                     \
    X(nvmlDeviceGetPowerManagementLimitConstraints)                                          \
    X(nvmlDeviceGetPowerManagementDefaultLimit)                                              \
    X(nvmlDeviceGetEnforcedPowerLimit)                                                       \
    X(nvmlDeviceGetCurrentClocksEventReasons)                                                \
    X(nvmlDeviceSetPowerManagementLimit)                                                     \
    X(nvmlDeviceSetPowerManagementLimit_v2)                                                  \
    X(nvmlDeviceSetGpuLockedClocks)                                                          \
    X(nvmlDeviceResetGpuLockedClocks)                                                        \
    X(nvmlEventSetCreate)                                                                    \
    X(nvmlEventSetFree)                                                                      \
    X(nvmlEventSetWait_v2)                                                                   \
    X(nvmlDeviceRegisterEvents)                                                              \
    X(nvmlDeviceGetSupportedEventTypes)                                                      \
    X(nvmlDeviceGetMemoryInfo)                                                               \
    X(nvmlDeviceSetApplicationsClocks)                                                       \
    X(nvmlDeviceResetApplicationsClocks)                                                     \
    X(nvmlDeviceGetMigMode)                                                                  \
    X(nvmlDeviceGetMaxMigDeviceCount)                                                        \
    X(nvmlDeviceGetMigDeviceHandleByIndex)                                                   \
    X(nvmlDeviceIsMigDeviceHandle)                                                           \
    X(nvmlDeviceGetDeviceHandleFromMigDeviceHandle)                                          \
    X(nvmlDeviceGetGpuInstanceId)                                                            \
    X(nvmlDeviceGetComputeInstanceId)

#define AS_ENUM(name) FN_##name,
#define AS_NAME(name) #name,
enum { FAKE_FUNCTIONS(AS_ENUM) FN_COUNT };
static const char *const function_names[FN_COUNT] = {FAKE_FUNCTIONS(AS_NAME)};

typedef struct {
    char uuid[96]; /* empty: no MIG device in this slot */
    char profile[32];
    long long gi; /* GPU instance id */
    long long ci; /* compute instance id */
    long long memory_mib;
} mig_t;

typedef struct {
    long long power_mw;
    long long power_avg_mw;
    long long energy_mj;
    long long gpu_temp_c;
    long long mem_temp_c;
    long long sm_clock_mhz;
    long long mem_clock_mhz;
    long long max_sm_clock_mhz;
    long long max_mem_clock_mhz;
    long long util_gpu_pct;
    long long util_mem_pct;
    long long power_limit_mw;
    long long power_limit_min_mw;
    long long power_limit_max_mw;
    long long power_limit_default_mw;
    long long external_limit_mw;
    long long locked_min_mhz; /* 0 when unlocked */
    long long locked_max_mhz;
    long long clock_event_reasons;
    long long pci_device_id;
    long long ecc_sbe_vol;
    long long ecc_dbe_vol;
    long long ecc_sbe_agg;
    long long ecc_dbe_agg;
    long long retired_sbe;
    long long retired_dbe;
    long long retired_pending;
    long long pcie_replay;
    long long remapped_cor;
    long long remapped_unc;
    long long remapped_pending;
    long long remapped_failure;
    long long sw_thermal_ns;
    long long hw_thermal_ns;
    long long power_brake_ns;
    long long xid_count;
    long long xid_code;
    long long mig_mode;    /* NVML_DEVICE_MIG_{DISABLE,ENABLE}; NONE: no MIG on this GPU */
    long long mig_pending;
    long long max_mig_devices;
    long long memory_total_mib;
    long long app_sm_clock_mhz; /* applications clocks (0: default) */
    long long app_mem_clock_mhz;
    char name[96];
    char uuid[96];
    char pci_bus_id[32];
    int error;
    int n_mem_clocks;
    unsigned int mem_clocks[MAX_CLOCKS];
    int n_sm_clocks;
    unsigned int sm_clocks[MAX_CLOCKS];
    int fail[FN_COUNT];
    int n_field_fails;
    unsigned int field_fail_id[MAX_FIELD_FAILS];
    int field_fail_code[MAX_FIELD_FAILS];
    mig_t mig[MAX_MIG];
} gpu_t;

static const struct {
    const char *key;
    size_t offset;
} numeric_fields[] = {
#define NUMERIC(field) {#field, offsetof(gpu_t, field)}
    NUMERIC(power_mw),          NUMERIC(power_avg_mw),
    NUMERIC(energy_mj),         NUMERIC(gpu_temp_c),
    NUMERIC(mem_temp_c),        NUMERIC(sm_clock_mhz),
    NUMERIC(mem_clock_mhz),     NUMERIC(max_sm_clock_mhz),
    NUMERIC(max_mem_clock_mhz), NUMERIC(util_gpu_pct),
    NUMERIC(util_mem_pct),      NUMERIC(power_limit_mw),
    NUMERIC(power_limit_min_mw), NUMERIC(power_limit_max_mw),
    NUMERIC(power_limit_default_mw), NUMERIC(external_limit_mw),
    NUMERIC(locked_min_mhz),    NUMERIC(locked_max_mhz),
    NUMERIC(clock_event_reasons), NUMERIC(pci_device_id),
    NUMERIC(ecc_sbe_vol),
    NUMERIC(ecc_dbe_vol),
    NUMERIC(ecc_sbe_agg),
    NUMERIC(ecc_dbe_agg),
    NUMERIC(retired_sbe),
    NUMERIC(retired_dbe),
    NUMERIC(retired_pending),
    NUMERIC(pcie_replay),
    NUMERIC(remapped_cor),
    NUMERIC(remapped_unc),
    NUMERIC(remapped_pending),
    NUMERIC(remapped_failure),
    NUMERIC(sw_thermal_ns),
    NUMERIC(hw_thermal_ns),
    NUMERIC(power_brake_ns),
    NUMERIC(xid_count),
    NUMERIC(xid_code),
    NUMERIC(mig_mode),
    NUMERIC(mig_pending),
    NUMERIC(max_mig_devices),
    NUMERIC(memory_total_mib),
    NUMERIC(app_sm_clock_mhz),
    NUMERIC(app_mem_clock_mhz),
#undef NUMERIC
};
#define N_NUMERIC (sizeof(numeric_fields) / sizeof(numeric_fields[0]))

typedef struct fake_device {
    int index;
    int mig; /* MIG device index in mig_handles; unused in handles */
} fake_device_t;
typedef fake_device_t *nvmlDevice_t;

static struct {
    int count;
    int n_slots; /* GPUs described in the file (may exceed count) */
    int privileged;
    int write_delay_ms;
    char driver_version[80];
    int fail[FN_COUNT];
    gpu_t gpus[MAX_GPUS];
} state;

static pthread_mutex_t mutex = PTHREAD_MUTEX_INITIALIZER;
static fake_device_t handles[MAX_GPUS];
static fake_device_t mig_handles[MAX_GPUS][MAX_MIG];
static char path_override[4096];
static int state_available;
static struct stat cached_stat;
static int init_count;
static unsigned long long call_counts[FN_COUNT];

/* ---- state defaults, parsing and writing ------------------------------------------- */

static long long *numeric_ptr(gpu_t *g, size_t i) {
    return (long long *)((char *)g + numeric_fields[i].offset);
}

static void default_gpu(gpu_t *g, int i) {
    static const unsigned buses[8] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};
    memset(g, 0, sizeof(*g));
    snprintf(g->name, sizeof(g->name), "NVIDIA H100 80GB HBM3");
    snprintf(g->uuid, sizeof(g->uuid), "GPU-fa4e0000-0000-4000-8000-%012x", (unsigned)i);
    snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "00000000:%02X:00.0",
             i < 8 ? buses[i] : (unsigned)(i + 1));
    g->power_mw = 350000;
    g->power_avg_mw = 345000;
    g->energy_mj = 1000000000LL + i;
    g->gpu_temp_c = 55;
    g->mem_temp_c = 62;
    g->sm_clock_mhz = 1980;
    g->mem_clock_mhz = 2619;
    g->max_sm_clock_mhz = 1980;
    g->max_mem_clock_mhz = 2619;
    g->util_gpu_pct = 90;
    g->util_mem_pct = 40;
    g->power_limit_mw = 700000;
    g->power_limit_min_mw = 200000;
    g->power_limit_max_mw = 700000;
    g->power_limit_default_mw = 700000;
    g->external_limit_mw = 700000;
    g->pci_device_id = 0x233010DE;
    g->mig_mode = 0;
    g->mig_pending = 0;
    g->max_mig_devices = 7;
    g->memory_total_mib = 81559;
    g->n_mem_clocks = 1;
    g->mem_clocks[0] = 2619;
    for (unsigned mhz = 1980; mhz >= 345 && g->n_sm_clocks < MAX_CLOCKS; mhz -= 15) {
        g->sm_clocks[g->n_sm_clocks++] = mhz;
    }
}

static void default_state(void) {
    memset(&state, 0, sizeof(state));
    state.count = 2;
    state.n_slots = 2;
    state.privileged = 1;
    state.write_delay_ms = 0;
    snprintf(state.driver_version, sizeof(state.driver_version), "560.35.03");
    for (int i = 0; i < MAX_GPUS; i++) {
        default_gpu(&state.gpus[i], i);
    }
}

static int function_id(const char *name) {
    for (int i = 0; i < FN_COUNT; i++) {
        if (strcmp(function_names[i], name) == 0) {
            return i;
        }
    }
    return -1;
}

static int parse_list(const char *value, unsigned int *out) {
    int n = 0;
    char *end;
    while (*value && n < MAX_CLOCKS) {
        unsigned long v = strtoul(value, &end, 10);
        if (end == value) {
            break;
        }
        out[n++] = (unsigned int)v;
        value = end;
    }
    return n;
}

static void apply_gpu_key(gpu_t *g, const char *key, const char *value) {
    if (strcmp(key, "name") == 0) {
        snprintf(g->name, sizeof(g->name), "%s", value);
    } else if (strcmp(key, "uuid") == 0) {
        snprintf(g->uuid, sizeof(g->uuid), "%s", value);
    } else if (strcmp(key, "pci_bus_id") == 0) {
        snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "%s", value);
    } else if (strcmp(key, "error") == 0) {
        g->error = atoi(value);
    } else if (strcmp(key, "supported_mem_clocks") == 0) {
        g->n_mem_clocks = parse_list(value, g->mem_clocks);
    } else if (strcmp(key, "supported_sm_clocks") == 0) {
        g->n_sm_clocks = parse_list(value, g->sm_clocks);
    } else if (strncmp(key, "fail.", 5) == 0) {
        int fn = function_id(key + 5);
        if (fn >= 0) {
            g->fail[fn] = atoi(value);
        }
    } else if (strncmp(key, "mig.", 4) == 0) {
        char *end;
        long k = strtol(key + 4, &end, 10);
        if (end == key + 4 || *end != '.' || k < 0 || k >= MAX_MIG) {
            return;
        }
        mig_t *m = &g->mig[k];
        const char *field = end + 1;
        if (strcmp(field, "uuid") == 0) {
            snprintf(m->uuid, sizeof(m->uuid), "%s", strcmp(value, "none") == 0 ? "" : value);
        } else if (strcmp(field, "profile") == 0) {
            snprintf(m->profile, sizeof(m->profile), "%s", strcmp(value, "none") == 0 ? "" : value);
        } else if (strcmp(field, "gi") == 0) {
            m->gi = strtoll(value, NULL, 0);
        } else if (strcmp(field, "ci") == 0) {
            m->ci = strtoll(value, NULL, 0);
        } else if (strcmp(field, "memory_mib") == 0) {
            m->memory_mib = strtoll(value, NULL, 0);
        }
    } else if (strncmp(key, "field_fail.", 11) == 0) {
        if (g->n_field_fails < MAX_FIELD_FAILS) {
            g->field_fail_id[g->n_field_fails] = (unsigned)strtoul(key + 11, NULL, 10);
            g->field_fail_code[g->n_field_fails] = atoi(value);
            g->n_field_fails++;
        }
    } else {
        for (size_t i = 0; i < N_NUMERIC; i++) {
            if (strcmp(key, numeric_fields[i].key) == 0) {
                *numeric_ptr(g, i) =
                    strcmp(value, "none") == 0 ? NONE : strtoll(value, NULL, 0);
                return;
            }
        }
    }
}

static void apply_line(char *line) {
    char *key = line;
    while (*key == ' ' || *key == '\t') {
        key++;
    }
    if (*key == '\0' || *key == '#') {
        return;
    }
    char *value = key;
    while (*value && *value != ' ' && *value != '\t') {
        value++;
    }
    if (*value) {
        *value++ = '\0';
    }
    while (*value == ' ' || *value == '\t') {
        value++;
    }
    size_t len = strlen(value);
    while (len > 0 && (value[len - 1] == ' ' || value[len - 1] == '\t' || value[len - 1] == '\r')) {
        value[--len] = '\0';
    }
    if (strcmp(key, "count") == 0) {
        state.count = atoi(value);
        if (state.count < 0) {
            state.count = 0;
        }
        if (state.count > MAX_GPUS) {
            state.count = MAX_GPUS;
        }
    } else if (strcmp(key, "privileged") == 0) {
        state.privileged = atoi(value);
    } else if (strcmp(key, "write_delay_ms") == 0) {
        state.write_delay_ms = atoi(value);
    } else if (strcmp(key, "driver_version") == 0) {
        snprintf(state.driver_version, sizeof(state.driver_version), "%s", value);
    } else if (strncmp(key, "fail.", 5) == 0) {
        int fn = function_id(key + 5);
        if (fn >= 0) {
            state.fail[fn] = atoi(value);
        }
    } else if (strncmp(key, "gpu.", 4) == 0) {
        char *end;
        long index = strtol(key + 4, &end, 10);
        if (end == key + 4 || *end != '.' || index < 0 || index >= MAX_GPUS) {
            return;
        }
        if (index + 1 > state.n_slots) {
            state.n_slots = (int)index + 1;
        }
        apply_gpu_key(&state.gpus[index], end + 1, value);
    }
}

static int load_state(const char *path) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return -1;
    }
    default_state();
    state.n_slots = 0;
    char line[8192];
    while (fgets(line, sizeof(line), f) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        apply_line(line);
    }
    fclose(f);
    if (state.n_slots < state.count) {
        state.n_slots = state.count;
    }
    return 0;
}

static const char *current_path(void) {
    if (path_override[0]) {
        return path_override;
    }
    const char *env = getenv("FAKE_NVML_STATE");
    return (env != NULL && env[0]) ? env : NULL;
}

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec;
}

/* The generation counter: 8 bytes in "<path>.gen", mapped shared. Every writer (this
   library or the Python helper) bumps it after replacing the state file, so checking for a
   change costs one memory read instead of a stat() per call. */
static volatile uint64_t *generation;
static uint64_t cached_generation;
static char generation_for[4096];
static long long last_stat_ns;

#define STAT_INTERVAL_NS 100000000LL /* also stat() every 100 ms, for hand edits */

static void map_generation(const char *path) {
    if (generation != NULL) {
        munmap((void *)generation, sizeof(uint64_t));
        generation = NULL;
    }
    snprintf(generation_for, sizeof(generation_for), "%s", path);
    char gen_path[4200];
    snprintf(gen_path, sizeof(gen_path), "%s.gen", path);
    int fd = open(gen_path, O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0) {
        return;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_size < (off_t)sizeof(uint64_t)) {
        if (ftruncate(fd, sizeof(uint64_t)) != 0) {
            close(fd);
            return;
        }
    }
    void *map = mmap(NULL, sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED) {
        generation = (volatile uint64_t *)map;
    }
}

static uint64_t read_generation(void) {
    return generation == NULL ? 0 : __atomic_load_n(generation, __ATOMIC_ACQUIRE);
}

static long long monotonic_coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Re-read the state file if it changed; called with the mutex held, on every call. */
static void refresh(void) {
    const char *path = current_path();
    if (path == NULL) {
        state_available = 0;
        return;
    }
    if (strcmp(path, generation_for) != 0) {
        map_generation(path);
        state_available = 0;
    }
    uint64_t gen = read_generation();
    long long now_ns = monotonic_coarse_ns();
    int gen_changed = generation == NULL || gen != cached_generation;
    if (state_available && !gen_changed && now_ns - last_stat_ns < STAT_INTERVAL_NS) {
        return;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        return; /* keep what we have (or nothing, if never loaded) */
    }
    last_stat_ns = now_ns;
    if (state_available && same_file(&st, &cached_stat)) {
        cached_generation = gen;
        return;
    }
    if (load_state(path) == 0) {
        state_available = 1;
        cached_stat = st;
        cached_generation = gen;
    }
}

static void write_state(const char *path) {
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (f == NULL) {
        return;
    }
    fprintf(f, "# fake libnvidia-ml.so.1 state (written back by the library)\n");
    fprintf(f, "count %d\nprivileged %d\nwrite_delay_ms %d\ndriver_version %s\n", state.count,
            state.privileged, state.write_delay_ms, state.driver_version);
    for (int fn = 0; fn < FN_COUNT; fn++) {
        if (state.fail[fn]) {
            fprintf(f, "fail.%s %d\n", function_names[fn], state.fail[fn]);
        }
    }
    for (int i = 0; i < state.n_slots; i++) {
        gpu_t *g = &state.gpus[i];
        fprintf(f, "gpu.%d.name %s\ngpu.%d.uuid %s\ngpu.%d.pci_bus_id %s\ngpu.%d.error %d\n", i,
                g->name, i, g->uuid, i, g->pci_bus_id, i, g->error);
        for (size_t k = 0; k < N_NUMERIC; k++) {
            long long v = *numeric_ptr(g, k);
            if (v == NONE) {
                fprintf(f, "gpu.%d.%s none\n", i, numeric_fields[k].key);
            } else {
                fprintf(f, "gpu.%d.%s %lld\n", i, numeric_fields[k].key, v);
            }
        }
        fprintf(f, "gpu.%d.supported_mem_clocks", i);
        for (int k = 0; k < g->n_mem_clocks; k++) {
            fprintf(f, " %u", g->mem_clocks[k]);
        }
        fprintf(f, "\ngpu.%d.supported_sm_clocks", i);
        for (int k = 0; k < g->n_sm_clocks; k++) {
            fprintf(f, " %u", g->sm_clocks[k]);
        }
        fprintf(f, "\n");
        for (int fn = 0; fn < FN_COUNT; fn++) {
            if (g->fail[fn]) {
                fprintf(f, "gpu.%d.fail.%s %d\n", i, function_names[fn], g->fail[fn]);
            }
        }
        for (int k = 0; k < g->n_field_fails; k++) {
            fprintf(f, "gpu.%d.field_fail.%u %d\n", i, g->field_fail_id[k], g->field_fail_code[k]);
        }
        for (int k = 0; k < MAX_MIG; k++) {
            const mig_t *m = &g->mig[k];
            if (m->uuid[0]) {
                fprintf(f, "gpu.%d.mig.%d.uuid %s\ngpu.%d.mig.%d.profile %s\n", i, k, m->uuid, i, k,
                        m->profile[0] ? m->profile : "none");
                fprintf(f, "gpu.%d.mig.%d.gi %lld\ngpu.%d.mig.%d.ci %lld\ngpu.%d.mig.%d.memory_mib %lld\n",
                        i, k, m->gi, i, k, m->ci, i, k, m->memory_mib);
            }
        }
    }
    /* Give every version a distinct mtime: the kernel's coarse file clock can stamp two
       quick writes alike, and a freed inode number can come back for the next file. */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long now_ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    long long old_ns =
        (long long)cached_stat.st_mtim.tv_sec * 1000000000LL + cached_stat.st_mtim.tv_nsec;
    if (now_ns <= old_ns) {
        now_ns = old_ns + 1000;
    }
    struct timespec times[2] = {{now_ns / 1000000000LL, now_ns % 1000000000LL},
                                {now_ns / 1000000000LL, now_ns % 1000000000LL}};
    int closed = fclose(f);
    if (closed != 0 || utimensat(AT_FDCWD, tmp, times, 0) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return;
    }
    struct stat st;
    if (stat(path, &st) == 0) {
        cached_stat = st;
    }
    if (generation != NULL) {
        cached_generation = __atomic_add_fetch(generation, 1, __ATOMIC_RELEASE);
    }
}

/* Take the cross-process lock for a read-modify-write of the state file. */
static int lock_state_file(void) {
    const char *path = current_path();
    if (path == NULL) {
        return -1;
    }
    char lock_path[4200];
    snprintf(lock_path, sizeof(lock_path), "%s.lock", path);
    int fd = open(lock_path, O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (fd < 0) {
        return -1;
    }
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    refresh(); /* pick up a change made by the test just before we took the lock */
    return fd;
}

static void commit_and_unlock(int fd) {
    const char *path = current_path();
    if (path != NULL) {
        write_state(path);
    }
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
}

/* ---- call plumbing ------------------------------------------------------------------ */

static nvmlReturn_t leave(nvmlReturn_t rc) {
    pthread_mutex_unlock(&mutex);
    return rc;
}

static nvmlReturn_t enter(int fn) {
    pthread_mutex_lock(&mutex);
    call_counts[fn]++;
    refresh();
    if (init_count <= 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    return state.fail[fn];
}

static nvmlReturn_t enter_device(int fn, nvmlDevice_t device, gpu_t **out) {
    pthread_mutex_lock(&mutex);
    call_counts[fn]++;
    refresh();
    if (init_count <= 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device < handles || device >= handles + MAX_GPUS || device->index >= state.count) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    gpu_t *g = &state.gpus[device->index];
    if (g->error) {
        return g->error;
    }
    if (g->fail[fn]) {
        return g->fail[fn];
    }
    if (state.fail[fn]) {
        return state.fail[fn];
    }
    *out = g;
    return NVML_SUCCESS;
}

#define DEVICE_CALL(fn)                                                                      \
    gpu_t *g = NULL;                                                                         \
    nvmlReturn_t rc = enter_device(FN_##fn, device, &g);                                     \
    if (rc != NVML_SUCCESS) {                                                                \
        return leave(rc);                                                                    \
    }

static int is_mig_handle(nvmlDevice_t device) {
    const fake_device_t *first = &mig_handles[0][0];
    return device >= first && device < first + MAX_GPUS * MAX_MIG;
}

static int mig_enabled(const gpu_t *g) { return g->mig_mode == NVML_DEVICE_MIG_ENABLE; }

/* Like enter_device, but a MIG device handle is accepted too: *mig is then its slot (NULL
   for a GPU handle). A MIG handle whose slot is gone (instance destroyed, MIG turned off)
   is INVALID_ARGUMENT, as NVML says of stale MIG handles. */
static nvmlReturn_t enter_any(int fn, nvmlDevice_t device, gpu_t **out, mig_t **mig) {
    *mig = NULL;
    if (!is_mig_handle(device)) {
        return enter_device(fn, device, out);
    }
    pthread_mutex_lock(&mutex);
    call_counts[fn]++;
    refresh();
    if (init_count <= 0) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device->index < 0 || device->index >= state.count || device->mig < 0 ||
        device->mig >= MAX_MIG) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    gpu_t *g = &state.gpus[device->index];
    if (g->error) {
        return g->error;
    }
    if (g->fail[fn]) {
        return g->fail[fn];
    }
    if (state.fail[fn]) {
        return state.fail[fn];
    }
    if (!mig_enabled(g) || !g->mig[device->mig].uuid[0]) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *out = g;
    *mig = &g->mig[device->mig];
    return NVML_SUCCESS;
}

#define ANY_CALL(fn)                                                                         \
    gpu_t *g = NULL;                                                                         \
    mig_t *mig = NULL;                                                                       \
    nvmlReturn_t rc = enter_any(FN_##fn, device, &g, &mig);                                  \
    if (rc != NVML_SUCCESS) {                                                                \
        return leave(rc);                                                                    \
    }

static long long min_known(long long a, long long b) {
    if (a == NONE) {
        return b;
    }
    if (b == NONE) {
        return a;
    }
    return a < b ? a : b;
}

static long long enforced_limit(const gpu_t *g) {
    return min_known(g->power_limit_mw, g->external_limit_mw);
}

static long long reported_power(const gpu_t *g, long long configured) {
    if (configured == NONE) {
        return NONE;
    }
    return min_known(configured, enforced_limit(g));
}

static long long reported_sm_clock(const gpu_t *g) {
    long long mhz = g->sm_clock_mhz;
    if (mhz == NONE || g->locked_max_mhz <= 0) {
        return mhz;
    }
    if (mhz > g->locked_max_mhz) {
        mhz = g->locked_max_mhz;
    }
    if (mhz < g->locked_min_mhz) {
        mhz = g->locked_min_mhz;
    }
    return mhz;
}

static nvmlReturn_t put_uint(unsigned int *out, long long value) {
    if (out == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (value == NONE) {
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *out = (unsigned int)value;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_string(char *out, unsigned int length, const char *value) {
    if (out == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (strlen(value) + 1 > length) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t put_list(unsigned int *count, unsigned int *out, const unsigned int *list,
                             int n) {
    if (count == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (*count < (unsigned)n || (out == NULL && n > 0)) {
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    *count = (unsigned)n;
    if (n > 0) {
        memcpy(out, list, sizeof(unsigned int) * (size_t)n);
    }
    return NVML_SUCCESS;
}

static long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/* ---- test hooks (not part of NVML) -------------------------------------------------- */

EXPORT void fakeNvmlSetStatePath(const char *path) {
    pthread_mutex_lock(&mutex);
    snprintf(path_override, sizeof(path_override), "%s", path != NULL ? path : "");
    state_available = 0;
    init_count = 0;
    generation_for[0] = '\0';
    memset(&cached_stat, 0, sizeof(cached_stat));
    refresh();
    pthread_mutex_unlock(&mutex);
}

EXPORT unsigned long long fakeNvmlCallCount(const char *name) {
    unsigned long long total = 0;
    pthread_mutex_lock(&mutex);
    for (int i = 0; i < FN_COUNT; i++) {
        if (name == NULL || strcmp(name, function_names[i]) == 0) {
            total += call_counts[i];
        }
    }
    pthread_mutex_unlock(&mutex);
    return total;
}

EXPORT void fakeNvmlResetCallCounts(void) {
    pthread_mutex_lock(&mutex);
    memset(call_counts, 0, sizeof(call_counts));
    pthread_mutex_unlock(&mutex);
}

EXPORT int fakeNvmlInitCount(void) {
    pthread_mutex_lock(&mutex);
    int n = init_count;
    pthread_mutex_unlock(&mutex);
    return n;
}

/* ---- NVML: library -------------------------------------------------------------------- */

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 21: return "No data";
    case 23: return "Insufficient resources";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 27: return "Not ready";
    case 28: return "GPU not found";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t do_init(int fn) {
    pthread_mutex_lock(&mutex);
    call_counts[fn]++;
    refresh();
    if (!state_available) {
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    if (state.fail[fn]) {
        return leave(state.fail[fn]);
    }
    init_count++;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init(FN_nvmlInitWithFlags);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(FN_nvmlInit_v2); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = enter(FN_nvmlShutdown);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    init_count--;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter(FN_nvmlSystemGetDriverVersion);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    return leave(put_string(version, length, state.driver_version));
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t rc = enter(FN_nvmlDeviceGetCount_v2);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    return leave(put_uint(count, state.count));
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&mutex);
    call_counts[FN_nvmlDeviceGetHandleByIndex_v2]++;
    refresh();
    if (init_count <= 0) {
        return leave(NVML_ERROR_UNINITIALIZED);
    }
    if (device == NULL || index >= (unsigned)state.count) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    gpu_t *g = &state.gpus[index];
    nvmlReturn_t rc = g->error ? g->error : g->fail[FN_nvmlDeviceGetHandleByIndex_v2];
    if (rc == NVML_SUCCESS) {
        rc = state.fail[FN_nvmlDeviceGetHandleByIndex_v2];
    }
    if (rc == NVML_SUCCESS) {
        handles[index].index = (int)index;
        *device = &handles[index];
    }
    return leave(rc);
}

/* ---- NVML: identity -------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ANY_CALL(nvmlDeviceGetUUID)
    return leave(put_string(uuid, length, mig != NULL ? mig->uuid : g->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ANY_CALL(nvmlDeviceGetName)
    if (mig == NULL) {
        return leave(put_string(name, length, g->name));
    }
    /* A MIG device is named after its parent and profile, e.g. "NVIDIA H100 80GB HBM3 MIG
       1g.10gb" (the form nvidia-smi -L and CUDA show). */
    char full[160];
    snprintf(full, sizeof(full), "%s MIG %s", g->name, mig->profile[0] ? mig->profile : "?");
    return leave(put_string(name, length, full));
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ANY_CALL(nvmlDeviceGetMemoryInfo)
    if (memory == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    long long mib = mig != NULL ? mig->memory_mib : g->memory_total_mib;
    if (mib == NONE || mib <= 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    memory->total = (unsigned long long)mib * 1024ULL * 1024ULL;
    memory->used = 0;
    memory->free = memory->total;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_CALL(nvmlDeviceGetPciInfo_v3)
    if (pci == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    memset(pci, 0, sizeof(*pci));
    unsigned domain = 0, bus = 0, dev = 0;
    sscanf(g->pci_bus_id, "%x:%x:%x", &domain, &bus, &dev);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = (unsigned int)g->pci_device_id;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.0", domain & 0xffff, bus,
             dev);
    snprintf(pci->busId, sizeof(pci->busId), "%s", g->pci_bus_id);
    return leave(NVML_SUCCESS);
}

/* ---- NVML: power, energy, temperatures ------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    DEVICE_CALL(nvmlDeviceGetPowerUsage)
    /* Ampere and newer report a 1 s average here; so does the fake. */
    long long mw = reported_power(g, g->power_avg_mw);
    if (mw == NONE) {
        mw = reported_power(g, g->power_mw);
    }
    return leave(put_uint(power, mw));
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                         unsigned long long *energy) {
    DEVICE_CALL(nvmlDeviceGetTotalEnergyConsumption)
    if (energy == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (g->energy_mj == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    *energy = (unsigned long long)g->energy_mj;
    return leave(NVML_SUCCESS);
}

static void field_value(const gpu_t *g, nvmlFieldValue_t *v, long long timestamp_us) {
    long long value = NONE;
    int type = VT_UINT;
    v->timestamp = timestamp_us;
    v->latencyUsec = 0;
    for (int k = 0; k < g->n_field_fails; k++) {
        if (g->field_fail_id[k] == v->fieldId) {
            v->nvmlReturn = g->field_fail_code[k];
            return;
        }
    }
    switch (v->fieldId) {
    case 82: value = g->mem_temp_c; break;
    case 185: value = reported_power(g, g->power_avg_mw); break;
    case 186: value = reported_power(g, g->power_mw); break;
    case 187: value = g->power_limit_min_mw; break;
    case 188: value = g->power_limit_max_mw; break;
    case 189: value = g->power_limit_default_mw; break;
    case 190: value = enforced_limit(g); break;
    case 191: value = g->energy_mj; type = VT_ULL; break;
    case 192: value = g->power_limit_mw; break;
    case 3: value = g->ecc_sbe_vol; type = VT_ULL; break;
    case 4: value = g->ecc_dbe_vol; type = VT_ULL; break;
    case 5: value = g->ecc_sbe_agg; type = VT_ULL; break;
    case 6: value = g->ecc_dbe_agg; type = VT_ULL; break;
    case 29: value = g->retired_sbe; type = VT_ULL; break;
    case 30: value = g->retired_dbe; type = VT_ULL; break;
    case 31: value = g->retired_pending; break;
    case 94: value = g->pcie_replay; break;
    case 142: value = g->remapped_cor; break;
    case 143: value = g->remapped_unc; break;
    case 144: value = g->remapped_pending; break;
    case 145: value = g->remapped_failure; break;
    case 269: value = g->sw_thermal_ns; type = VT_ULL; break;
    case 270: value = g->hw_thermal_ns; type = VT_ULL; break;
    case 271: value = g->power_brake_ns; type = VT_ULL; break;
    default: break;
    }
    if (value == NONE) {
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        return;
    }
    v->nvmlReturn = NVML_SUCCESS;
    v->valueType = type;
    if (type == VT_ULL) {
        v->value.ullVal = (unsigned long long)value;
    } else {
        v->value.ullVal = 0;
        v->value.uiVal = (unsigned int)value;
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int count,
                                             nvmlFieldValue_t *values) {
    DEVICE_CALL(nvmlDeviceGetFieldValues)
    if (count < 0 || (values == NULL && count > 0)) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    long long ts = now_us();
    for (int i = 0; i < count; i++) {
        field_value(g, &values[i], ts);
    }
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temp) {
    DEVICE_CALL(nvmlDeviceGetTemperatureV)
    if (temp == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (temp->version != TEMPERATURE_V1) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    if (temp->sensorType != 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    if (g->gpu_temp_c == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    temp->temperature = (int)g->gpu_temp_c;
    return leave(NVML_SUCCESS);
}

/* ---- NVML: clocks, utilisation -------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned int *clock) {
    DEVICE_CALL(nvmlDeviceGetClockInfo)
    switch (type) {
    case 0: /* graphics */
    case 1: return leave(put_uint(clock, reported_sm_clock(g))); /* SM */
    case 2: return leave(put_uint(clock, g->mem_clock_mhz));
    case 3: return leave(NVML_ERROR_NOT_SUPPORTED); /* video */
    default: return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type,
                                              unsigned int *clock) {
    DEVICE_CALL(nvmlDeviceGetMaxClockInfo)
    switch (type) {
    case 0:
    case 1: return leave(put_uint(clock, g->max_sm_clock_mhz));
    case 2: return leave(put_uint(clock, g->max_mem_clock_mhz));
    case 3: return leave(NVML_ERROR_NOT_SUPPORTED);
    default: return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count,
                                                       unsigned int *clocks) {
    DEVICE_CALL(nvmlDeviceGetSupportedMemoryClocks)
    if (g->n_mem_clocks == 0) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return leave(put_list(count, clocks, g->mem_clocks, g->n_mem_clocks));
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t device,
                                                         unsigned int memory_mhz,
                                                         unsigned int *count,
                                                         unsigned int *clocks) {
    DEVICE_CALL(nvmlDeviceGetSupportedGraphicsClocks)
    int known = 0;
    for (int k = 0; k < g->n_mem_clocks; k++) {
        known |= g->mem_clocks[k] == memory_mhz;
    }
    if (!known) {
        return leave(NVML_ERROR_NOT_FOUND);
    }
    return leave(put_list(count, clocks, g->sm_clocks, g->n_sm_clocks));
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    DEVICE_CALL(nvmlDeviceGetUtilizationRates)
    if (util == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (mig_enabled(g) || g->util_gpu_pct == NONE || g->util_mem_pct == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    util->gpu = (unsigned int)g->util_gpu_pct;
    util->memory = (unsigned int)g->util_mem_pct;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons) {
    DEVICE_CALL(nvmlDeviceGetCurrentClocksEventReasons)
    if (reasons == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (g->clock_event_reasons == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    unsigned long long mask = (unsigned long long)g->clock_event_reasons;
    long long enforced = enforced_limit(g);
    if (g->power_mw != NONE && enforced != NONE && g->power_mw > enforced) {
        mask |= 0x4; /* SW power cap */
    }
    if (g->sm_clock_mhz != NONE && g->locked_max_mhz > 0 && g->sm_clock_mhz > g->locked_max_mhz) {
        mask |= 0x2; /* applications clocks setting (a lock below demand) */
    }
    *reasons = mask;
    return leave(NVML_SUCCESS);
}

/* ---- NVML: power limits ----------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL(nvmlDeviceGetPowerManagementLimit)
    return leave(put_uint(limit, g->power_limit_mw));
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device,
                                                                 unsigned int *min_limit,
                                                                 unsigned int *max_limit) {
    DEVICE_CALL(nvmlDeviceGetPowerManagementLimitConstraints)
    rc = put_uint(min_limit, g->power_limit_min_mw);
    if (rc == NVML_SUCCESS) {
        rc = put_uint(max_limit, g->power_limit_max_mw);
    }
    return leave(rc);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device,
                                                             unsigned int *limit) {
    DEVICE_CALL(nvmlDeviceGetPowerManagementDefaultLimit)
    return leave(put_uint(limit, g->power_limit_default_mw));
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    DEVICE_CALL(nvmlDeviceGetEnforcedPowerLimit)
    return leave(put_uint(limit, enforced_limit(g)));
}

/* A slow driver: the write takes effect only after the delay (outside the state lock). */
static void write_delay(void) {
    if (state.write_delay_ms > 0) {
        struct timespec ts = {state.write_delay_ms / 1000, (state.write_delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static nvmlReturn_t set_power_limit(gpu_t *g, unsigned int limit_mw) {
    write_delay();
    int fd = lock_state_file();
    nvmlReturn_t rc = NVML_SUCCESS;
    if (!state.privileged) {
        rc = NVML_ERROR_NO_PERMISSION;
    } else if (g->power_limit_mw == NONE || g->power_limit_min_mw == NONE ||
               g->power_limit_max_mw == NONE) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (limit_mw < g->power_limit_min_mw || limit_mw > g->power_limit_max_mw) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        g->power_limit_mw = limit_mw;
        commit_and_unlock(fd);
        return NVML_SUCCESS;
    }
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t device, unsigned int limit) {
    DEVICE_CALL(nvmlDeviceSetPowerManagementLimit)
    return leave(set_power_limit(g, limit));
}

EXPORT nvmlReturn_t nvmlDeviceSetPowerManagementLimit_v2(nvmlDevice_t device,
                                                         nvmlPowerValue_v2_t *value) {
    DEVICE_CALL(nvmlDeviceSetPowerManagementLimit_v2)
    if (value == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (value->version != POWER_VALUE_V2) {
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    if (value->powerScope > 1) { /* GPU or MODULE only */
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return leave(set_power_limit(g, value->powerValueMw));
}

/* ---- NVML: locked clocks ---------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceSetGpuLockedClocks(nvmlDevice_t device, unsigned int min_mhz,
                                                 unsigned int max_mhz) {
    DEVICE_CALL(nvmlDeviceSetGpuLockedClocks)
    write_delay();
    int fd = lock_state_file();
    /* NVML_CLOCK_LIMIT_ID_{TDP,UNLIMITED}: the lowest / highest clock the GPU can run. */
    long long lo = min_mhz >= CLOCK_LIMIT_ID_RANGE_START ? 1 : (long long)min_mhz;
    long long hi = max_mhz >= CLOCK_LIMIT_ID_RANGE_START
                       ? (g->max_sm_clock_mhz == NONE ? 100000 : g->max_sm_clock_mhz)
                       : (long long)max_mhz;
    if (mig_enabled(g)) {
        rc = NVML_ERROR_NOT_SUPPORTED; /* no clock control on a MIG-enabled GPU */
    } else if (!state.privileged) {
        rc = NVML_ERROR_NO_PERMISSION;
    } else if (lo > hi || hi == 0) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        g->locked_min_mhz = lo;
        g->locked_max_mhz = hi;
        commit_and_unlock(fd);
        return leave(NVML_SUCCESS);
    }
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
    return leave(rc);
}

EXPORT nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t device) {
    DEVICE_CALL(nvmlDeviceResetGpuLockedClocks)
    write_delay();
    int fd = lock_state_file();
    if (mig_enabled(g) || !state.privileged) {
        if (fd >= 0) {
            flock(fd, LOCK_UN);
            close(fd);
        }
        return leave(mig_enabled(g) ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_NO_PERMISSION);
    }
    g->locked_min_mhz = 0;
    g->locked_max_mhz = 0;
    commit_and_unlock(fd);
    return leave(NVML_SUCCESS);
}

/* ---- NVML: applications clocks (deprecated in NVML 13; polca does not use them) ------- */

static nvmlReturn_t set_app_clocks(gpu_t *g, long long mem_mhz, long long sm_mhz) {
    write_delay();
    int fd = lock_state_file();
    nvmlReturn_t rc = NVML_SUCCESS;
    if (mig_enabled(g)) {
        rc = NVML_ERROR_NOT_SUPPORTED;
    } else if (!state.privileged) {
        rc = NVML_ERROR_NO_PERMISSION;
    } else {
        g->app_mem_clock_mhz = mem_mhz;
        g->app_sm_clock_mhz = sm_mhz;
        commit_and_unlock(fd);
        return NVML_SUCCESS;
    }
    if (fd >= 0) {
        flock(fd, LOCK_UN);
        close(fd);
    }
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceSetApplicationsClocks(nvmlDevice_t device, unsigned int mem_mhz,
                                                    unsigned int sm_mhz) {
    DEVICE_CALL(nvmlDeviceSetApplicationsClocks)
    if (mem_mhz == 0 || sm_mhz == 0) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    return leave(set_app_clocks(g, mem_mhz, sm_mhz));
}

EXPORT nvmlReturn_t nvmlDeviceResetApplicationsClocks(nvmlDevice_t device) {
    DEVICE_CALL(nvmlDeviceResetApplicationsClocks)
    return leave(set_app_clocks(g, 0, 0));
}

/* ---- NVML: MIG ----------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                         unsigned int *pending) {
    DEVICE_CALL(nvmlDeviceGetMigMode)
    if (current == NULL || pending == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (g->mig_mode == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED); /* a GPU without MIG (pre-Ampere, GeForce) */
    }
    *current = (unsigned int)g->mig_mode;
    *pending = (unsigned int)(g->mig_pending == NONE ? g->mig_mode : g->mig_pending);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    DEVICE_CALL(nvmlDeviceGetMaxMigDeviceCount)
    if (count == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    /* nvml.h: "Returns zero if MIG is not supported or enabled." */
    long long n = mig_enabled(g) && g->max_mig_devices != NONE ? g->max_mig_devices : 0;
    *count = (unsigned int)(n < 0 ? 0 : n);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                        nvmlDevice_t *mig_device) {
    DEVICE_CALL(nvmlDeviceGetMigDeviceHandleByIndex)
    if (mig_device == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (!mig_enabled(g)) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    if (g->max_mig_devices == NONE || (long long)index >= g->max_mig_devices) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if (index >= MAX_MIG || !g->mig[index].uuid[0]) {
        return leave(NVML_ERROR_NOT_FOUND);
    }
    fake_device_t *h = &mig_handles[device->index][index];
    h->index = device->index;
    h->mig = (int)index;
    *mig_device = h;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *is_mig) {
    ANY_CALL(nvmlDeviceIsMigDeviceHandle)
    if (is_mig == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *is_mig = mig != NULL;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t device,
                                                                 nvmlDevice_t *parent) {
    ANY_CALL(nvmlDeviceGetDeviceHandleFromMigDeviceHandle)
    if (parent == NULL || mig == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    handles[device->index].index = device->index;
    *parent = &handles[device->index];
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t put_instance_id(mig_t *mig, unsigned int *id, long long value) {
    if (id == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (mig == NULL) {
        return NVML_ERROR_NOT_SUPPORTED; /* a GPU handle has no instance ids */
    }
    *id = (unsigned int)value;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    ANY_CALL(nvmlDeviceGetGpuInstanceId)
    return leave(put_instance_id(mig, id, mig != NULL ? mig->gi : 0));
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    ANY_CALL(nvmlDeviceGetComputeInstanceId)
    return leave(put_instance_id(mig, id, mig != NULL ? mig->ci : 0));
}

/* ---- NVML: events (XID) ----------------------------------------------------------------- */

#define EVENT_TYPE_XID 0x8ULL
#define NVML_ERROR_TIMEOUT_CODE 10

typedef struct {
    int registered[MAX_GPUS];
    long long delivered[MAX_GPUS];
} fake_event_set_t;
typedef fake_event_set_t *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t rc = enter(FN_nvmlEventSetCreate);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    if (set == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *set = calloc(1, sizeof(fake_event_set_t));
    return leave(*set == NULL ? 999 : NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = enter(FN_nvmlEventSetFree);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    free(set);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                     unsigned long long *types) {
    DEVICE_CALL(nvmlDeviceGetSupportedEventTypes)
    if (types == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    *types = g->xid_count == NONE ? 0 : EVENT_TYPE_XID;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                             nvmlEventSet_t set) {
    DEVICE_CALL(nvmlDeviceRegisterEvents)
    if (set == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    if ((types & EVENT_TYPE_XID) == 0 || g->xid_count == NONE) {
        return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    set->registered[device->index] = 1;
    set->delivered[device->index] = g->xid_count;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                        unsigned int timeout_ms) {
    nvmlReturn_t rc = enter(FN_nvmlEventSetWait_v2);
    if (rc != NVML_SUCCESS) {
        return leave(rc);
    }
    if (set == NULL || data == NULL) {
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
    for (int i = 0; i < state.count && i < MAX_GPUS; i++) {
        const gpu_t *g = &state.gpus[i];
        if (!set->registered[i] || g->xid_count == NONE || g->xid_count <= set->delivered[i]) {
            continue;
        }
        set->delivered[i]++;
        handles[i].index = i;
        data->device = &handles[i];
        data->eventType = EVENT_TYPE_XID;
        data->eventData = (unsigned long long)g->xid_code;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return leave(NVML_SUCCESS);
    }
    (void)timeout_ms; /* nothing waits: a test raises xid_count before it reads */
    return leave(NVML_ERROR_TIMEOUT_CODE);
}
